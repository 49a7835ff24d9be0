"""Triton SiLU-and-mul: ``silu(gate) * up`` for the gated MLP, computed in float32.

``silu_and_mul_fp8`` writes the result as ``kernels.fp8_linear``'s pre-quantized input
(float8_e4m3fn values and a float32 scale a token) instead: a row's scale needs its amax,
so a program owns a row (as ``pagoda_kernels/_triton/fp8_quant.py``): held in registers up to
``ONE_PASS_MAX`` elements, else computed twice (amax, then quantize; the second read of
gate and up mostly from L2). The values quantized are those ``silu_and_mul`` would store
(rounded to x's dtype), so the result is what quantizing its output gives."""

import torch
import triton
import triton.language as tl

from pagoda_kernels._triton.fp8_quant import fp8_scale, one_pass_block, to_fp8
from pagoda_kernels._triton.pdl import launch_pdl, wait_for_inputs
from pagoda_kernels.fp8_quant import FP8_DTYPE, Fp8Activations


@triton.jit
def _silu_mul(x_row, cols, mask, width):
    # silu(gate) * up over columns ``cols`` of one row, in float32 (masked lanes: zero).
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + width + cols, mask=mask, other=0.0).to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, width, BLOCK: tl.constexpr):
    wait_for_inputs()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    result = _silu_mul(x_ptr + row * stride_x, cols, mask, width)
    tl.store(out_ptr + row * stride_o + cols, result.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr, q_ptr, qs_ptr, stride_x, stride_q, width,
    BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
):  # fmt: skip
    wait_for_inputs()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    # Each value is rounded to x's dtype (silu_and_mul's output) before it is quantized.
    if ONE_PASS:
        mask = offs < width
        result = _silu_mul(x_row, offs, mask, width).to(x_ptr.dtype.element_ty).to(tl.float32)
        scale = fp8_scale(tl.max(tl.abs(result), axis=0))
        tl.store(q_row + offs, to_fp8(result, scale), mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, width, BLOCK):
            cols = start + offs
            result = _silu_mul(x_row, cols, cols < width, width)
            result = result.to(x_ptr.dtype.element_ty).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(result))
        scale = fp8_scale(tl.max(amax, axis=0))
        for start in range(0, width, BLOCK):
            cols = start + offs
            mask = cols < width
            result = _silu_mul(x_row, cols, mask, width)
            result = result.to(x_ptr.dtype.element_ty).to(tl.float32)
            tl.store(q_row + cols, to_fp8(result, scale), mask=mask)
    tl.store(qs_ptr + row, scale)


def _gate_up_rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    width = x.shape[-1] // 2
    x_rows = _gate_up_rows(x)
    out = torch.empty((x_rows.shape[0], width), dtype=x.dtype, device=x.device)
    if out.numel():
        block = min(1024, triton.next_power_of_2(width))
        _silu_and_mul_kernel[(x_rows.shape[0], triton.cdiv(width, block))](
            x_rows, out, x_rows.stride(0), out.stride(0), width,
            BLOCK=block, num_warps=4 if block >= 512 else 1,
            launch_pdl=launch_pdl(x_rows),
        )  # fmt: skip
    return out.view(*x.shape[:-1], width)


def silu_and_mul_fp8(x: torch.Tensor) -> Fp8Activations:
    width = x.shape[-1] // 2
    x_rows = _gate_up_rows(x)
    q = torch.empty((x_rows.shape[0], width), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((x_rows.shape[0], 1), dtype=torch.float32, device=x.device)
    if q.numel():
        block, num_warps, one_pass = one_pass_block(width)
        _silu_and_mul_fp8_kernel[(x_rows.shape[0],)](
            x_rows, q, scale, x_rows.stride(0), q.stride(0), width,
            BLOCK=block, ONE_PASS=one_pass, num_warps=num_warps,
            launch_pdl=launch_pdl(x_rows),
        )  # fmt: skip
    leading = x.shape[:-1]
    return Fp8Activations(q.view(*leading, width), scale.view(*leading, 1), x.dtype)
