"""Triton int4 linear: a dequantizing GEMV for decode-sized steps and a GEMM that
dequantizes weight tiles into ``tl.dot``. Layout and numerics: ``pagoda_kernels/int4_linear.py``.

Both take only tensors and constexprs (the group size, whether a g_idx is given, the
blocks), so a CUDA graph replays them as captured.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagoda_kernels._triton.linear import _store_row, reduce_splits
from pagoda_kernels._triton.pdl import launch_pdl, wait_for_inputs


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
def _word_codes(words, magic, CODE_BASE: tl.constexpr, DTYPE: tl.constexpr):
    """[BLOCK_N, BLOCK_W, 8] in DTYPE, exact: CODE_BASE + the eight codes of each word of
    words [BLOCK_N, BLOCK_W], in K order.

    Half precision (bf16: CODE_BASE 128, MAGIC 0x43004300; fp16: 1024, 0x64006400):
    (words >> 4i) & 0x000F000F | MAGIC holds codes i and i + 4 as the two half values
    CODE_BASE + code (where one unit in the last place is 1), so each 32-bit shift, AND
    and OR serves two codes; the halves are split off by truncation to 16 bits and a
    bitcast. tl.join then puts a word's codes next to each other (new axes: code bit 2,
    bit 1, bit 0), so the reshape is K order and x needs no permutation. float32 (CODE_BASE
    0): the exponent trick, code | 0x4B000000 is 2^23 + code."""
    if CODE_BASE == 0:
        shifts = (tl.arange(0, 8) * 4)[None, None, :]
        codes = (words[:, :, None] >> shifts) & 0xF
        return (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    else:
        t0 = (words & 0x000F000F) | magic
        t1 = ((words >> 4) & 0x000F000F) | magic
        t2 = ((words >> 8) & 0x000F000F) | magic
        t3 = ((words >> 12) & 0x000F000F) | magic
        # p_i [BLOCK_N, BLOCK_W, 2]: codes i, i + 4.
        p0 = tl.join(t0.to(tl.int16).to(DTYPE, bitcast=True),
                     (t0 >> 16).to(tl.int16).to(DTYPE, bitcast=True))  # fmt: skip
        p1 = tl.join(t1.to(tl.int16).to(DTYPE, bitcast=True),
                     (t1 >> 16).to(tl.int16).to(DTYPE, bitcast=True))  # fmt: skip
        p2 = tl.join(t2.to(tl.int16).to(DTYPE, bitcast=True),
                     (t2 >> 16).to(tl.int16).to(DTYPE, bitcast=True))  # fmt: skip
        p3 = tl.join(t3.to(tl.int16).to(DTYPE, bitcast=True),
                     (t3 >> 16).to(tl.int16).to(DTYPE, bitcast=True))  # fmt: skip
        # [BLOCK_N, BLOCK_W, 2, 2, 2]: index (a, b, c) is code 4a + 2b + c.
        v = tl.join(tl.join(p0, p2), tl.join(p1, p3))
        return tl.reshape(v, [v.shape[0], v.shape[1], 8])


@triton.jit(do_not_specialize=["M"])
def _int4_gemv_dot_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, ws_ptr,
                          M, N, K, stride_x, stride_q, stride_o, num_groups, words_per_split,
                          magic, GROUP_SIZE: tl.constexpr, TILE_META: tl.constexpr,
                          SCALE_AFTER: tl.constexpr, X_SUM_DOT: tl.constexpr,
                          CODE_BASE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          M_PAD: tl.constexpr, EVEN_K: tl.constexpr, USE_WS: tl.constexpr,
                          HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """One program: out.T [BLOCK_N, M_PAD] (x rows M_PAD * pid_m on) for one slice of K,
    as tl.dot(weight tile [BLOCK_N, BLOCK_K], x.T [BLOCK_K, M_PAD]): "swap AB", so the
    unpacked tile is the first operand (on sm_90 wgmma takes it from registers, after one
    layout change through shared memory: a 16-byte store and an ldmatrix per 8 codes) and
    x, its rows past M zeros, the second; float32 accumulation.

    TILE_META (BLOCK_K divides the group size, or one group): one scale and zero per
    (n, tile). Then with SCALE_AFTER the dot takes the tile of CODE_BASE + code as it is
    unpacked and the partial is scaled after it, per output and row:
    s * (dot - (CODE_BASE + zero) * sum_k x) in float32. No per-code arithmetic beyond the
    unpacking, and the weight is never rounded to x's dtype (float32 loses ~4 bits of its
    24 to the cancellation: bf16's 128 + code against 128 + zero). sum_k x comes from a
    second dot of a ones tile with x.T (X_SUM_DOT: already in the accumulator's layout, at
    the cost of materializing the ones) or from a reduction of x.T across threads.

    Otherwise (or with groups smaller than the tile: scale and zero per word) every code
    is dequantized in float32, (CODE_BASE + code - (CODE_BASE + zero)) * scale, and rounded
    once to x's dtype: the weight ``dequantize_into`` gives. (Triton's interpreter does
    bf16 arithmetic on bf16's uint16 storage, so bf16 math in the dot's dtype could not be
    checked on CPU.) The magic constant is an argument, not a constexpr, so that ptxas
    folds each AND + OR of the unpacking into one LOP3 (two immediates cannot be)."""
    wait_for_inputs()
    BLOCK_W: tl.constexpr = BLOCK_K // 8
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(2) * M_PAD + tl.arange(0, M_PAD)
    n_row = tl.minimum(offs_n, N - 1).to(tl.int64)
    num_words = tl.cdiv(K, 8)
    q_rows = qweight_ptr + n_row[:, None] * stride_q
    meta_row = n_row * num_groups
    x_cols = x_ptr + offs_m.to(tl.int64)[None, :] * stride_x
    m_mask = (offs_m < M)[None, :]
    offs_c = tl.arange(0, BLOCK_K)
    if X_SUM_DOT:
        # (float32 then cast: the interpreter has no bf16 constants)
        ones = tl.full([BLOCK_N, BLOCK_K], 1.0, tl.float32).to(DTYPE)
    acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    w_start = pid_k * words_per_split
    for w0 in range(w_start, w_start + words_per_split, BLOCK_W):
        wk = w0 + tl.arange(0, BLOCK_W)
        ks = w0 * 8 + offs_c
        if EVEN_K:
            words = tl.load(q_rows + wk[None, :], eviction_policy="evict_first")
            xt = tl.load(x_cols + ks[:, None], mask=m_mask, other=0.0)
        else:
            words = tl.load(q_rows + wk[None, :], mask=(wk < num_words)[None, :], other=0,
                            eviction_policy="evict_first")  # fmt: skip
            xt = tl.load(x_cols + ks[:, None], mask=(ks < K)[:, None] & m_mask, other=0.0)
        codes = _word_codes(words, magic, CODE_BASE, DTYPE)
        if TILE_META:
            meta = meta_row + tl.minimum((w0 * 8) // GROUP_SIZE, num_groups - 1)
            s = tl.load(scales_ptr + meta).to(tl.float32)[:, None]
            zb = tl.load(zeros_ptr + meta).to(tl.float32)[:, None] + CODE_BASE
            if SCALE_AFTER:
                part = tl.dot(tl.reshape(codes, [BLOCK_N, BLOCK_K]), xt,
                              input_precision=PRECISION)  # fmt: skip
                if X_SUM_DOT:
                    x_sum = tl.dot(ones, xt, input_precision=PRECISION)
                else:
                    x_sum = tl.sum(xt.to(tl.float32), axis=0)[None, :]
                acc += s * (part - zb * x_sum)
            else:
                w = (codes.to(tl.float32) - zb[:, :, None]) * s[:, :, None]
                acc = tl.dot(tl.reshape(w.to(DTYPE), [BLOCK_N, BLOCK_K]), xt, acc,
                             input_precision=PRECISION)  # fmt: skip
        else:
            meta = meta_row[:, None] + tl.minimum((wk * 8) // GROUP_SIZE, num_groups - 1)[None, :]
            s = tl.load(scales_ptr + meta).to(tl.float32)
            zb = tl.load(zeros_ptr + meta).to(tl.float32) + CODE_BASE
            w = (codes.to(tl.float32) - zb[:, :, None]) * s[:, :, None]
            acc = tl.dot(tl.reshape(w.to(DTYPE), [BLOCK_N, BLOCK_K]), xt, acc,
                         input_precision=PRECISION)  # fmt: skip
    mask = (offs_n[:, None] < N) & m_mask
    if USE_WS:
        rows = (pid_k * M + offs_m).to(tl.int64)
        tl.store(ws_ptr + rows[None, :] * N + offs_n[:, None], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + offs_m[None, :] * stride_o + offs_n[:, None],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)  # fmt: skip


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
        reduce_splits(workspace, bias, out, split)
    return out



@dataclass(frozen=True)
class DotConfig:
    """A launch of the tensor-core GEMV (``int4_gemv_dot``): tiles of BLOCK_N outputs x
    BLOCK_K inputs (block_k a multiple of 16), K in ``split`` slices (float32 partials,
    reduced in a fixed order), 16 rows of x a program. ``scale_after``: with one group a
    tile, scale the dot of the unpacked codes instead of dequantizing every code.
    ``x_sum`` (for scale_after): "dot" (a ones tile times x.T), "reduce" (across threads)
    or "auto": "reduce" from 32 tile rows a warp, else "dot" (the one with fewer SASS
    instructions in the loop, sm_90, over the benchmark's grid). A block_k above a group
    size that is a multiple of 16 is lowered to the group size, so that a tile never spans
    groups where it need not (the per-word scale path costs ~2.5x the instructions a code).
    """

    block_n: int = 64
    block_k: int = 128
    split: int = 1
    num_warps: int = 4
    num_stages: int = 3
    scale_after: bool = True
    x_sum: str = "auto"


DOT_M_PAD = 16  # rows of x a program: the smallest N of a tl.dot

# x's dtype: CODE_BASE and the magic constant of the unpacking (``_word_codes``).
_CODE_BASE = {torch.float32: (0, 0), torch.bfloat16: (128, 0x43004300),
              torch.float16: (1024, 0x64006400)}  # fmt: skip


def dot_launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None,
               out: torch.Tensor, config: DotConfig) -> tuple[tuple, tuple, dict]:  # fmt: skip
    """(grid, arguments, keywords) of ``_int4_gemv_dot_kernel`` for ``int4_gemv_dot``
    (arguments[6] is the split-K workspace, ``out`` when K is not split); separate so
    that a sweep can compile its launches ahead (``JITFunction.warmup``)."""
    m, k = x.shape
    n = qweight.shape[0]
    num_groups = scales.shape[1]
    if not words_eligible(group_size, num_groups, None):
        raise ValueError(f"int4_gemv_dot: groups of {group_size} split a word")
    if config.block_k < 16 or config.block_k % 16:
        raise ValueError(f"int4_gemv_dot: block_k {config.block_k} is not a multiple of 16")
    if config.x_sum not in ("auto", "dot", "reduce"):
        raise ValueError(f"int4_gemv_dot: x_sum {config.x_sum!r}")
    block_k = config.block_k
    if num_groups > 1 and group_size % 16 == 0 and group_size < block_k:
        block_k = group_size
    block_w = block_k // 8
    num_words = triton.cdiv(k, 8)
    per_split = triton.cdiv(triton.cdiv(num_words, config.split), block_w) * block_w
    split = triton.cdiv(num_words, per_split)
    use_ws = split > 1
    workspace = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if use_ws else out
    # Slices start at multiples of block_k, so a group size that block_k divides puts
    # every tile in one group.
    tile_meta = num_groups == 1 or group_size % block_k == 0
    scale_after = tile_meta and config.scale_after
    x_sum = config.x_sum
    if x_sum == "auto":
        x_sum = "reduce" if config.block_n >= 32 * config.num_warps else "dot"
    code_base, magic = _CODE_BASE[x.dtype]
    grid = (triton.cdiv(n, config.block_n), split, triton.cdiv(m, DOT_M_PAD))
    args = (x, qweight, scales, zeros, qweight if bias is None else bias, out, workspace, m, n, k,
            x.stride(0), qweight.stride(0), out.stride(0), num_groups, per_split, magic)  # fmt: skip
    meta = dict(GROUP_SIZE=max(group_size, 1), TILE_META=tile_meta, SCALE_AFTER=scale_after,
                X_SUM_DOT=scale_after and x_sum == "dot", CODE_BASE=code_base,
                BLOCK_N=config.block_n, BLOCK_K=block_k, M_PAD=DOT_M_PAD,
                EVEN_K=k == 8 * per_split * split, USE_WS=use_ws, HAS_BIAS=bias is not None,
                PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                num_warps=config.num_warps, num_stages=config.num_stages,
                launch_pdl=launch_pdl(out))  # fmt: skip
    return grid, args, meta


def dot_wins_at_one_row(n: int, k: int) -> bool:
    """At one row the tensor-core GEMV beats the word GEMV on the H200 for the 7B's wide and
    square projections (gate_up 50.6 vs 63.5 us, o 9.3 vs 10.1, qkv a tie) and loses on
    the small ones and on long K (1.5B qkv 5.0 vs 4.7, 7B down 45.9 vs 39.5:
    int4_check_dot_h200.json); the 1.5B's gate_up (K 1536) is a tie (14.4 vs 14.6) and
    keeps the word GEMV. From two rows on it wins everywhere (its time does not grow with
    the rows up to 16; the word GEMV's does)."""
    return 2048 <= k <= n and n * k >= 12 * 1024 * 1024


def dot_config_for(n: int, k: int) -> DotConfig:
    """The launch measured best on one H200 (``benchmarks/int4_check.py --dot-m``,
    Qwen2.5-1.5B and 7B projections, groups of 128, the same at 1, 4 and 16 rows): wide
    projections (gate_up) in 64 x 64 tiles, K in halves, 4 stages; long K (down) split 4
    ways in 128 x 128 tiles of 8 warps, or 8 ways in 64 x 128 for narrow N; the rest
    64 x 128, split 8 ways from 8M weights, else 4."""
    if n >= 4 * k:
        return DotConfig(block_n=64, block_k=64, split=2, num_stages=4)
    if k >= 4 * n:
        if n >= 3072:
            return DotConfig(block_n=128, block_k=128, split=4, num_warps=8)
        return DotConfig(block_n=64, block_k=128, split=8)
    return DotConfig(block_n=64, block_k=128, split=8 if n * k >= 8 * 1024 * 1024 else 4)


def int4_gemv_dot(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                  zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None,
                  out: torch.Tensor, config: DotConfig) -> torch.Tensor:  # fmt: skip
    """out [M, N] (rows contiguous) = x [M, K] @ W.T (+ bias) by the tensor-core GEMV.
    Same eligibility as the word GEMV (``words_eligible``: no act order)."""
    grid, args, meta = dot_launch(x, qweight, scales, zeros, group_size, bias, out, config)
    pdl = meta.pop("launch_pdl")
    _int4_gemv_dot_kernel[grid](*args, launch_pdl=pdl, **meta)
    if meta["USE_WS"]:
        reduce_splits(args[6], bias, out, grid[1])
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
        if m == 1 and not dot_wins_at_one_row(n, k):
            return int4_gemv_words(x, qweight, scales, zeros, group_size, bias, out,
                                   words_config_for(m, n, k))  # fmt: skip
        return int4_gemv_dot(x, qweight, scales, zeros, group_size, bias, out,
                             dot_config_for(n, k))  # fmt: skip
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
