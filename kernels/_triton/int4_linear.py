"""Triton int4 linear: a dequantizing GEMV for decode-sized steps and a GEMM that
dequantizes weight tiles into ``tl.dot``. Layout and numerics: ``kernels/int4_linear.py``.

Both take only tensors and constexprs (the group size, whether a g_idx is given, the
blocks), so a CUDA graph replays them as captured.
"""

import torch
import triton
import triton.language as tl

from kernels._triton.pdl import launch_pdl, wait_for_inputs


@triton.jit
def _dequantized_tile(qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, offs_k, offs_n, N, K,
                      stride_q, num_groups, GROUP_SIZE: tl.constexpr,
                      HAS_G_IDX: tl.constexpr):  # fmt: skip
    """float32 [BLOCK_K, BLOCK_N]: W.T at rows offs_k, columns offs_n (0 outside)."""
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    words = tl.load(qweight_ptr + offs_n[None, :] * stride_q + (offs_k[:, None] // 8),
                    mask=mask, other=0)  # fmt: skip
    codes = (words >> ((offs_k[:, None] % 8) * 4)) & 0xF
    if HAS_G_IDX:
        groups = tl.load(g_idx_ptr + offs_k, mask=offs_k < K, other=0)
    else:
        groups = offs_k // GROUP_SIZE
    meta = offs_n[None, :] * num_groups + groups[:, None]
    scale = tl.load(scales_ptr + meta, mask=mask, other=0.0)
    zero = tl.load(zeros_ptr + meta, mask=mask, other=0).to(tl.float32)
    return (codes.to(tl.float32) - zero) * scale


@triton.jit
def _int4_gemv_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, bias_ptr, out_ptr,
                      N, K, stride_x, stride_q, num_groups, GROUP_SIZE: tl.constexpr,
                      HAS_G_IDX: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """One program: BLOCK_N outputs of one row of x, float32 multiply-adds over K."""
    wait_for_inputs()
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        weight = _dequantized_tile(qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, offs_k, offs_n,
                                   N, K, stride_q, num_groups, GROUP_SIZE, HAS_G_IDX)  # fmt: skip
        acc += tl.sum(weight * x[:, None], axis=0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + offs_n, acc.to(out_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _int4_gemm_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, bias_ptr, out_ptr,
                      M, N, K, stride_x, stride_q, num_groups, GROUP_SIZE: tl.constexpr,
                      HAS_G_IDX: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PRECISION: tl.constexpr):  # fmt: skip
    """One program: a [BLOCK_M, BLOCK_N] tile of the output; weight tiles dequantized to
    x's dtype for the tensor cores, float32 accumulation."""
    wait_for_inputs()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)  # fmt: skip
        weight = _dequantized_tile(qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, offs_k, offs_n,
                                   N, K, stride_q, num_groups, GROUP_SIZE, HAS_G_IDX)  # fmt: skip
        acc = tl.dot(x, weight.to(x.dtype), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)  # fmt: skip


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor, group_size: int, g_idx: torch.Tensor | None,
                bias: torch.Tensor | None, out: torch.Tensor | None,
                gemv: bool) -> torch.Tensor:  # fmt: skip
    """x [M, K] contiguous -> [M, N] (into ``out`` when given: contiguous, x's dtype)."""
    m, k = x.shape
    n = qweight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    # Unused pointers still need a tensor; the constexpr flags keep them unread.
    g_idx_arg = qweight if g_idx is None else g_idx
    bias_arg = qweight if bias is None else bias
    common = dict(GROUP_SIZE=max(group_size, 1), HAS_G_IDX=g_idx is not None,
                  HAS_BIAS=bias is not None)  # fmt: skip
    if gemv:
        block_n = 32
        grid = (triton.cdiv(n, block_n), m)
        _int4_gemv_kernel[grid](x, qweight, scales, zeros, g_idx_arg, bias_arg, out, n, k,
                                x.stride(0), qweight.stride(0), scales.shape[1],
                                BLOCK_N=block_n, BLOCK_K=64, launch_pdl=launch_pdl(out),
                                **common)  # fmt: skip
        return out
    block_m, block_n, block_k = 32, 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _int4_gemm_kernel[grid](x, qweight, scales, zeros, g_idx_arg, bias_arg, out, m, n, k,
                            x.stride(0), qweight.stride(0), scales.shape[1],
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                            PRECISION=precision, launch_pdl=launch_pdl(out),
                            **common)  # fmt: skip
    return out
