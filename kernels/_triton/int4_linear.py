"""Triton int4 linear: a dequantizing GEMV for decode-sized steps and a GEMM that
dequantizes weight tiles into ``tl.dot``. Layout and numerics: ``kernels/int4_linear.py``.

Both take only tensors and constexprs (the group size, whether a g_idx is given, the
blocks), so a CUDA graph replays them as captured.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._triton.linear import _splitk_reduce_kernel, _store_row
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
def _x_at(x_ptr, row, M, stride_x, ks, zero_n, K):
    # x[row, ks] broadcast over the tile's BLOCK_N rows: the weight tile's register layout
    # (each thread loads the x elements it multiplies, from L1). Rows past M are clamped.
    r = tl.minimum(row, M - 1).to(tl.int64)
    ptrs = x_ptr + r * stride_x + zero_n[:, None] + ks[None, :]
    return tl.load(ptrs, mask=(ks < K)[None, :], other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["M"])
def _int4_gemv_words_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
                          ws_ptr, M, N, K, stride_x, stride_q, num_groups, words_per_split,
                          GROUP_SIZE: tl.constexpr, ROWS: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                          USE_WS: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """One program: BLOCK_N outputs x a slice of K for ROWS rows of x (rows ROWS * pid_m
    on). Tiles are [BLOCK_N, BLOCK_W words, 8 codes]: 16-byte loads of packed words along
    K, one 16-byte load of x's eight inputs a word, one variable shift a code. A word's
    eight codes share a group (GROUP_SIZE a multiple of 8, or one group), so each word
    needs one scale and zero. Codes become float32 by the exponent trick (code | 0x4B000000
    is 2^23 + code), not by the quarter-rate int-to-float conversion; W = code * s - z * s
    in one FMA (exact: the true value fits float32). Measured on the H200 against a 2D
    [BLOCK_N, BLOCK_W] variant that loaded x element by element: 1.3-1.6x faster."""
    wait_for_inputs()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    row0 = tl.program_id(2) * ROWS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_row = tl.minimum(offs_n, N - 1).to(tl.int64)
    num_words = tl.cdiv(K, 8)
    q_rows = qweight_ptr + n_row[:, None] * stride_q
    meta_rows = n_row[:, None] * num_groups
    offs_j = tl.arange(0, 8)
    shifts = (offs_j * 4)[None, None, :]
    zero3 = tl.zeros([BLOCK_N, 1, 1], dtype=tl.int32)
    acc0 = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    w_start = pid_k * words_per_split
    for w0 in range(w_start, w_start + words_per_split, BLOCK_W):
        wk = w0 + tl.arange(0, BLOCK_W)
        words = tl.load(q_rows + wk[None, :], mask=(wk < num_words)[None, :], other=0,
                        eviction_policy="evict_first")  # fmt: skip
        meta = meta_rows + tl.minimum((wk * 8) // GROUP_SIZE, num_groups - 1)[None, :]
        s = tl.load(scales_ptr + meta)
        zs = tl.load(zeros_ptr + meta).to(tl.float32) * s
        codes = (words[:, :, None] >> shifts) & 0xF
        w = (((codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0) * s[:, :, None]
             - zs[:, :, None])  # fmt: skip
        ks = (wk[:, None] * 8 + offs_j[None, :])[None, :, :]
        x_ptrs = x_ptr + zero3 + ks
        k_mask = ks < K
        r0 = tl.minimum(row0, M - 1).to(tl.int64) * stride_x
        acc0 += tl.sum(w * tl.load(x_ptrs + r0, mask=k_mask, other=0.0).to(tl.float32), axis=2)
        if ROWS > 1:
            r1 = tl.minimum(row0 + 1, M - 1).to(tl.int64) * stride_x
            acc1 += tl.sum(w * tl.load(x_ptrs + r1, mask=k_mask, other=0.0).to(tl.float32),
                           axis=2)  # fmt: skip
        if ROWS > 2:
            r2 = tl.minimum(row0 + 2, M - 1).to(tl.int64) * stride_x
            r3 = tl.minimum(row0 + 3, M - 1).to(tl.int64) * stride_x
            acc2 += tl.sum(w * tl.load(x_ptrs + r2, mask=k_mask, other=0.0).to(tl.float32),
                           axis=2)  # fmt: skip
            acc3 += tl.sum(w * tl.load(x_ptrs + r3, mask=k_mask, other=0.0).to(tl.float32),
                           axis=2)  # fmt: skip
    _store_row(acc0, row0, pid_k, out_ptr, ws_ptr, bias_ptr, offs_n, M, N, N,
               HAS_BIAS, USE_WS, False, BLOCK_N)  # fmt: skip
    if ROWS > 1:
        _store_row(acc1, row0 + 1, pid_k, out_ptr, ws_ptr, bias_ptr, offs_n, M, N, N,
                   HAS_BIAS, USE_WS, False, BLOCK_N)  # fmt: skip
    if ROWS > 2:
        _store_row(acc2, row0 + 2, pid_k, out_ptr, ws_ptr, bias_ptr, offs_n, M, N, N,
                   HAS_BIAS, USE_WS, False, BLOCK_N)  # fmt: skip
        _store_row(acc3, row0 + 3, pid_k, out_ptr, ws_ptr, bias_ptr, offs_n, M, N, N,
                   HAS_BIAS, USE_WS, False, BLOCK_N)  # fmt: skip


@triton.jit
def _int4_dequant_kernel(qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, out_ptr, N, K,
                         stride_q, num_groups, GROUP_SIZE: tl.constexpr,
                         HAS_G_IDX: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_W: tl.constexpr):  # fmt: skip
    """out [N, K] (x's dtype) = W: one [BLOCK_N, BLOCK_W words x 8] tile a program."""
    wait_for_inputs()
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    wk = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_j = tl.arange(0, 8)
    n_mask = (offs_n < N)[:, None]
    words = tl.load(qweight_ptr + offs_n.to(tl.int64)[:, None] * stride_q + wk[None, :],
                    mask=n_mask & (wk < tl.cdiv(K, 8))[None, :], other=0)  # fmt: skip
    ks = (wk[:, None] * 8 + offs_j[None, :])[None, :, :]
    k_mask = ks < K
    if HAS_G_IDX:
        groups = tl.load(g_idx_ptr + ks, mask=k_mask, other=0)
    else:
        groups = tl.minimum(ks // GROUP_SIZE, num_groups - 1)
    meta = offs_n.to(tl.int64)[:, None, None] * num_groups + groups
    mask3 = n_mask[:, :, None] & k_mask
    s = tl.load(scales_ptr + meta, mask=mask3, other=0.0)
    z = tl.load(zeros_ptr + meta, mask=mask3, other=0).to(tl.float32)
    codes = (words[:, :, None] >> (offs_j * 4)[None, None, :]) & 0xF
    w = ((codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0 - z) * s
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None, None] * K + ks,
             w.to(out_ptr.dtype.element_ty), mask=mask3)  # fmt: skip


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


@dataclass(frozen=True)
class WordsConfig:
    """A launch of the word GEMV: BLOCK_N outputs x BLOCK_W words a tile, K in ``split``
    slices (float32 partials, reduced in a fixed order), ``rows`` rows of x a program."""

    block_n: int = 16
    block_w: int = 32
    split: int = 1
    rows: int = 1
    num_warps: int = 4


def words_eligible(group_size: int, num_groups: int, g_idx: torch.Tensor | None) -> bool:
    """The word GEMV needs a word's eight codes in one group: no act order, and groups of
    a multiple of 8 (or one group: per channel)."""
    return g_idx is None and (group_size % 8 == 0 or num_groups == 1)


def words_config_for(m: int, n: int, k: int) -> WordsConfig:
    """The launch measured best on one H200 (``benchmarks/int4_check.py``, Qwen2.5-1.5B
    and 7B projections, groups of 128, results/int4_check_h200.json): up
    to 4 rows, tiles of 8 outputs x 64 words unless that gives too few programs (then K
    split 4 ways, or 8 for K >= 16k); above, 4-row blocks of 16 outputs x 32 words, K in
    halves, except for wide projections of short K."""
    if m <= 4:
        rows = 1 if m <= 1 else 2 if m <= 2 else 4
        if k >= 16384:
            return WordsConfig(block_n=8, block_w=32, split=8, rows=rows)
        if triton.cdiv(n, 8) < 400:
            return WordsConfig(block_n=8, block_w=32, split=4, rows=rows)
        return WordsConfig(block_n=8, block_w=64, split=1, rows=rows)
    if n >= 4096 and k < 8192:
        return WordsConfig(block_n=8, block_w=64, split=1, rows=4)
    return WordsConfig(block_n=16, block_w=32, split=2, rows=4)


def int4_gemv_words(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None,
                    out: torch.Tensor, config: WordsConfig) -> torch.Tensor:  # fmt: skip
    """out [M, N] (contiguous) = x [M, K] @ W.T (+ bias) by the word GEMV."""
    m, k = x.shape
    n = qweight.shape[0]
    num_words = triton.cdiv(k, 8)
    per_split = triton.cdiv(triton.cdiv(num_words, config.split), config.block_w) * config.block_w
    split = triton.cdiv(num_words, per_split)
    use_ws = split > 1
    workspace = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if use_ws else out
    bias_arg = qweight if bias is None else bias
    grid = (triton.cdiv(n, config.block_n), split, triton.cdiv(m, config.rows))
    _int4_gemv_words_kernel[grid](x, qweight, scales, zeros, bias_arg, out, workspace, m, n, k,
                                  x.stride(0), qweight.stride(0), scales.shape[1], per_split,
                                  GROUP_SIZE=max(group_size, 1), ROWS=config.rows,
                                  BLOCK_N=config.block_n, BLOCK_W=config.block_w,
                                  USE_WS=use_ws, HAS_BIAS=bias is not None,
                                  num_warps=config.num_warps, launch_pdl=launch_pdl(out))  # fmt: skip
    if use_ws:
        block = min(1024, triton.next_power_of_2(n))
        _splitk_reduce_kernel[(m, triton.cdiv(n, block))](
            workspace, bias_arg, out, m, n, out.stride(0), split,
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4 if block >= 512 else 1,
            launch_pdl=launch_pdl(out),
        )  # fmt: skip
    return out


def dequantize_into(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, g_idx: torch.Tensor | None, k: int,
                    out: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """out [N, K] (contiguous, x's dtype) = the weight the layout means."""
    n = qweight.shape[0]
    block_n, block_w = 16, 16
    grid = (triton.cdiv(n, block_n), triton.cdiv(triton.cdiv(k, 8), block_w))
    _int4_dequant_kernel[grid](qweight, scales, zeros, qweight if g_idx is None else g_idx, out,
                               n, k, qweight.stride(0), scales.shape[1],
                               GROUP_SIZE=max(group_size, 1), HAS_G_IDX=g_idx is not None,
                               BLOCK_N=block_n, BLOCK_W=block_w,
                               launch_pdl=launch_pdl(out))  # fmt: skip
    return out


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
    if gemv and words_eligible(group_size, scales.shape[1], g_idx):
        return int4_gemv_words(x, qweight, scales, zeros, group_size, bias, out,
                               words_config_for(m, n, k))  # fmt: skip
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
