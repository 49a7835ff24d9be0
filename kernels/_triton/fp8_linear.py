"""Triton FP8 skinny GEMM for decode-sized steps (M <= 8): ``kernels.fp8_linear``'s W8A8
scheme with float8_e4m3fn weights and per-token dynamic activation scales.

The structure is the bf16 ``fma`` GEMV's (``kernels/_triton/linear.py``): a program owns
``BLOCK_N`` weight rows x a K slice, streams ``[BLOCK_N, BLOCK_K]`` weight tiles with
16-byte ``evict_first`` loads (16 fp8 elements, half the bytes of bf16 for the same
work), and keeps one float32 accumulator per token row, folded in-thread and reduced over
K once after the loop. What is new:

- each program first computes its rows' activation scales (``amax / 448`` over all of K:
  x is a few KB, read from L2), so the quantization costs no launch of its own;
- x is rounded to float8_e4m3fn in registers as it is used (``x / scale``, clamped), so
  the products are exactly the reference's fp8 x fp8 products;
- the float32 sum is scaled by ``x_scale[m] * weight_scale[n]`` before the bias, or before
  the split-K partials go to the workspace (the bf16 kernel's fixed-order reduce then adds
  the bias and casts: deterministic, CUDA-graph safe).
"""

import torch
import triton
import triton.language as tl

from kernels._gemv_table import FMA_MAX_M, GemvConfig
from kernels._triton.linear import _fold, _rows, _rows_bucket, _splitk_reduce_kernel, _x_row

FP8_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1.0 / (448.0 * 512.0))


@triton.jit
def _row_scale(x_ptr, row, M, stride_xm, K, BLOCK_K: tl.constexpr):
    # The dynamic activation scale of token row ``row`` (clamped to M - 1 as the loads).
    r = tl.minimum(row, M - 1).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        ks = k + offs
        xv = tl.load(x_ptr + r * stride_xm + ks, mask=ks < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(xv))
    return tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)


@triton.jit
def _xq_row(x_ptr, row, scale, M, stride_xm, ks, zero_n, EVEN_K: tl.constexpr, K):
    # Token row ``row`` of x, quantized to fp8 and widened back: the value the MMA of the
    # scheme would see, in the weight tile's register layout.
    xv = _x_row(x_ptr, row, M, stride_xm, ks, zero_n, EVEN_K, K) / scale
    xv = tl.minimum(tl.maximum(xv, -FP8_MAX), FP8_MAX)
    return xv.to(tl.float8e4nv).to(tl.float32)


@triton.jit
def _store_row(
    acc, row, x_scale, w_scale, pid_k, out_ptr, ws_ptr, b_ptr, offs_n, M, N, stride_om,
    HAS_BIAS: tl.constexpr, USE_WS: tl.constexpr,
):  # fmt: skip
    total = tl.sum(acc, axis=1) * (x_scale * w_scale)
    mask = (offs_n < N) & (row < M)
    if USE_WS:
        tl.store(ws_ptr + (pid_k * M + row).to(tl.int64) * N + offs_n, total, mask=mask)
    else:
        if HAS_BIAS:
            total += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, k_per_split,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_WS: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past N are clamped (loads stay unmasked along N; stores are masked).
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn
    w_scale = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)
    offs_k = tl.arange(0, BLOCK_K)
    zero_n = tl.zeros([BLOCK_N], dtype=tl.int32)
    s0 = _row_scale(x_ptr, 0, M, stride_xm, K, BLOCK_K)
    s1 = s0
    s2 = s0
    s3 = s0
    s4 = s0
    s5 = s0
    s6 = s0
    s7 = s0
    if ROWS > 1:
        s1 = _row_scale(x_ptr, 1, M, stride_xm, K, BLOCK_K)
    if ROWS > 2:
        s2 = _row_scale(x_ptr, 2, M, stride_xm, K, BLOCK_K)
        s3 = _row_scale(x_ptr, 3, M, stride_xm, K, BLOCK_K)
    if ROWS > 4:
        s4 = _row_scale(x_ptr, 4, M, stride_xm, K, BLOCK_K)
        s5 = _row_scale(x_ptr, 5, M, stride_xm, K, BLOCK_K)
        s6 = _row_scale(x_ptr, 6, M, stride_xm, K, BLOCK_K)
        s7 = _row_scale(x_ptr, 7, M, stride_xm, K, BLOCK_K)
    acc0 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    acc4 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    acc5 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    acc6 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    acc7 = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k in range(k_start, k_start + k_per_split, BLOCK_K):
        ks = k + offs_k
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :], eviction_policy="evict_first")
        else:
            w = tl.load(
                w_rows + ks[None, :], mask=(ks < K)[None, :], other=0.0,
                eviction_policy="evict_first",
            )  # fmt: skip
        w = w.to(tl.float32)
        acc0 += _fold(w * _xq_row(x_ptr, 0, s0, M, stride_xm, ks, zero_n, EVEN_K, K), VEC)
        if ROWS > 1:
            acc1 += _fold(w * _xq_row(x_ptr, 1, s1, M, stride_xm, ks, zero_n, EVEN_K, K), VEC)
        if ROWS > 2:
            acc2 += _fold(w * _xq_row(x_ptr, 2, s2, M, stride_xm, ks, zero_n, EVEN_K, K), VEC)
            acc3 += _fold(w * _xq_row(x_ptr, 3, s3, M, stride_xm, ks, zero_n, EVEN_K, K), VEC)
        if ROWS > 4:
            acc4 += _fold(w * _xq_row(x_ptr, 4, s4, M, stride_xm, ks, zero_n, EVEN_K, K), VEC)
            acc5 += _fold(w * _xq_row(x_ptr, 5, s5, M, stride_xm, ks, zero_n, EVEN_K, K), VEC)
            acc6 += _fold(w * _xq_row(x_ptr, 6, s6, M, stride_xm, ks, zero_n, EVEN_K, K), VEC)
            acc7 += _fold(w * _xq_row(x_ptr, 7, s7, M, stride_xm, ks, zero_n, EVEN_K, K), VEC)
    _store_row(acc0, 0, s0, w_scale, pid_k, out_ptr, ws_ptr, b_ptr, offs_n, M, N, stride_om,
               HAS_BIAS, USE_WS)  # fmt: skip
    if ROWS > 1:
        _store_row(acc1, 1, s1, w_scale, pid_k, out_ptr, ws_ptr, b_ptr, offs_n, M, N,
                   stride_om, HAS_BIAS, USE_WS)  # fmt: skip
    if ROWS > 2:
        _store_row(acc2, 2, s2, w_scale, pid_k, out_ptr, ws_ptr, b_ptr, offs_n, M, N,
                   stride_om, HAS_BIAS, USE_WS)  # fmt: skip
        _store_row(acc3, 3, s3, w_scale, pid_k, out_ptr, ws_ptr, b_ptr, offs_n, M, N,
                   stride_om, HAS_BIAS, USE_WS)  # fmt: skip
    if ROWS > 4:
        _store_row(acc4, 4, s4, w_scale, pid_k, out_ptr, ws_ptr, b_ptr, offs_n, M, N,
                   stride_om, HAS_BIAS, USE_WS)  # fmt: skip
        _store_row(acc5, 5, s5, w_scale, pid_k, out_ptr, ws_ptr, b_ptr, offs_n, M, N,
                   stride_om, HAS_BIAS, USE_WS)  # fmt: skip
        _store_row(acc6, 6, s6, w_scale, pid_k, out_ptr, ws_ptr, b_ptr, offs_n, M, N,
                   stride_om, HAS_BIAS, USE_WS)  # fmt: skip
        _store_row(acc7, 7, s7, w_scale, pid_k, out_ptr, ws_ptr, b_ptr, offs_n, M, N,
                   stride_om, HAS_BIAS, USE_WS)  # fmt: skip


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: GemvConfig,
) -> torch.Tensor:
    """out[M, N] = fp8 scheme of x[M, K] @ weight[N, K].T (+ bias); ``config`` must be an
    fma config. ``x`` and ``weight`` need a unit stride along K, ``out`` along N."""
    m, k = x.shape
    n = weight.shape[0]
    if m == 0 or n == 0:
        return out
    if k == 0 or config.kind != "fma" or m > FMA_MAX_M:
        raise ValueError(f"unsupported FP8 GEMV case: M={m}, K={k}, {config.short()}")
    block_k = config.block_k
    split = max(1, min(config.split_k, triton.cdiv(k, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)  # no empty slices
    use_ws = split > 1
    workspace = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if use_ws else out
    bias_arg = bias if bias is not None else out
    _fp8_gemv_kernel[(triton.cdiv(n, config.block_n), split)](
        x, weight, weight_scale, bias_arg, out, workspace,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_per_split,
        ROWS=_rows_bucket(m), BLOCK_N=config.block_n, BLOCK_K=block_k, USE_WS=use_ws,
        HAS_BIAS=bias is not None, EVEN_K=k % k_per_split == 0,
        VEC=min(16 // weight.element_size(), block_k),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if use_ws:
        block = min(1024, triton.next_power_of_2(n))
        _splitk_reduce_kernel[(m, triton.cdiv(n, block))](
            workspace, bias_arg, out, m, n, out.stride(0), split,
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4 if block >= 512 else 1,
        )  # fmt: skip
    return out


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``kernels.fp8_linear`` for x [..., K]; the caller checked eligibility."""
    rows = _rows(x)
    n = weight.shape[0]
    if out is None:
        out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    launch(rows, weight, weight_scale, bias, out.view(rows.shape[0], n), config)
    return out.view(*x.shape[:-1], n)
