"""Triton kernel of ``kernels.fp8_quant``: one program per token row; the row's amax,
then ``row / scale`` clamped and rounded to float8_e4m3fn (round to nearest even, as
torch's cast). ``fp8_scale`` and ``to_fp8`` are the scheme's two steps, shared with the
kernels that quantize the rows they produce (RMSNorm, SiLU-and-mul), so every producer
rounds exactly as this kernel does."""

import torch
import triton
import triton.language as tl

from pagoda_kernels._triton.pdl import launch_pdl, wait_for_inputs

FP8_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1.0 / (448.0 * 512.0))
# Rows up to this many elements are held in registers and read once; longer rows are read
# twice (amax, then quantize), the second time mostly from L2.
ONE_PASS_MAX = 8192


@triton.jit
def fp8_scale(amax):
    # The scheme's per-token scale from the row's largest |value| (float32).
    return tl.maximum(amax / FP8_MAX, MIN_SCALE)


@triton.jit
def to_fp8(values, scale):
    # float32 values / scale, clamped to +-448, rounded to float8_e4m3fn.
    return tl.minimum(tl.maximum(values / scale, -FP8_MAX), FP8_MAX).to(tl.float8e4nv)


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm,
    BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr,
):  # fmt: skip
    wait_for_inputs()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    if ONE_PASS:
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        scale = fp8_scale(tl.max(tl.abs(x), axis=0))
        tl.store(q_row + offs, to_fp8(x, scale), mask=offs < K)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            ks = k + offs
            x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = fp8_scale(tl.max(amax, axis=0))
        for k in range(0, K, BLOCK_K):
            ks = k + offs
            x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
            tl.store(q_row + ks, to_fp8(x, scale), mask=ks < K)
    tl.store(s_ptr + row, scale)


def one_pass_block(width: int) -> tuple[int, int, bool]:
    """(block, warps, one pass) for a program that quantizes a row of ``width``: the whole
    row in registers up to ONE_PASS_MAX elements, else that many a step."""
    block = min(triton.next_power_of_2(width), ONE_PASS_MAX)
    return block, 1 if block <= 256 else 4 if block <= 2048 else 8, width <= block


def quantize_per_token(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = rows.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=rows.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=rows.device)
    block_k, num_warps, one_pass = one_pass_block(k)
    _quantize_kernel[(m,)](
        rows, q, scale, k, rows.stride(0), q.stride(0),
        BLOCK_K=block_k, ONE_PASS=one_pass, num_warps=num_warps,
        launch_pdl=launch_pdl(rows),
    )  # fmt: skip
    return q, scale
