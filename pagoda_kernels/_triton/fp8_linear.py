"""Triton FP8 skinny GEMM for decode-sized steps (M <= 8): ``kernels.fp8_linear``'s W8A8
scheme with float8_e4m3fn weights and dynamic per-token activation scales.

At batch 1 an H200 streams ~4.8 T fp8 weight elements a second, which leaves a handful of
ALU operations per weight element: the first version (x re-quantized on every
``[BLOCK_N, BLOCK_K]`` tile, once per weight row) was ALU-bound and slower than bf16. Each
kernel here keeps the per-weight-element work at a conversion and an FMA, or hands the
weights to the tensor cores untouched. Four config kinds (``GemvConfig.kind``):

- ``fma``: the bf16 fma GEMV's structure (``pagoda_kernels/_triton/linear.py``): a program owns
  ``BLOCK_N`` weight rows x a K slice, 16-byte ``evict_first`` weight loads, one float32
  accumulator per token row, folded in-thread. The program computes its rows' activation
  scales first (a pass over x, from L2: no launch of its own), then quantizes each x K-tile
  once as a 1-D vector and broadcasts it over the tile's rows.
- ``fmaq``: the same loop over x quantized beforehand (``pagoda_kernels/_triton/fp8_quant.py``, one
  extra tiny launch; no amax pass per program), x loaded as fp8 in the weight tile's layout.
- ``dot``: swap-AB tensor cores: ``out^T = W @ x^T`` with the fp8 weight tile
  ``[BLOCK_N >= 64, BLOCK_K]`` as the MMA's A operand and the fp8-quantized x^T
  ``[BLOCK_K, 16]`` (M padded to 16) as B, both K-major; the weights go from memory to the
  MMA with no per-element work. float32 partial sums are promoted every ``BLOCK_K``
  (``max_num_imprecise_acc``), as cuBLASLt's default (no fast accumulation) does.
- ``dotq``: the same over x quantized beforehand.

The float32 sum is scaled by ``x_scale[m] * weight_scale[n]`` before the bias, or before the
split-K partials go to the workspace (a fixed-order reduce then adds the bias and casts:
deterministic, CUDA-graph safe, nothing read back to the host).
"""

import torch
import triton
import triton.language as tl

from pagoda_kernels._gemv_table import FMA_MAX_M, GemvConfig
from pagoda_kernels._triton.fp8_quant import quantize_per_token
from pagoda_kernels._triton.linear import _fold, _rows, _rows_bucket, reduce_splits
from pagoda_kernels._triton.pdl import launch_pdl, wait_for_inputs
from pagoda_kernels.fp8_quant import Fp8Activations

FP8_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1.0 / (448.0 * 512.0))
DOT_BLOCK_M = 16  # tl.dot's smallest operand side: M = 1..8 padded to it
KINDS = ("fma", "fmaq", "dot", "dotq")


@triton.jit
def _quantize(xv, scale):
    # The scheme's rounding: x / scale, clamped to +-448, to float8_e4m3fn.
    xv = xv / scale
    return tl.minimum(tl.maximum(xv, -FP8_MAX), FP8_MAX).to(tl.float8e4nv)


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
def _scale_of(x_ptr, xs_ptr, row, M, stride_xm, K, BLOCK_K: tl.constexpr, PREQUANT: tl.constexpr):
    if PREQUANT:
        return tl.load(xs_ptr + tl.minimum(row, M - 1))
    else:
        return _row_scale(x_ptr, row, M, stride_xm, K, BLOCK_K)


@triton.jit
def _xq_row(
    x_ptr, row, scale, M, stride_xm, ks, zero_n, EVEN_K: tl.constexpr, K, PREQUANT: tl.constexpr
):  # fmt: skip
    # Token row ``row``'s K-tile as fp8 values widened to float32 (rows past M clamped to
    # M - 1: their results are not stored). In-kernel quantization (``fma``): a [1, BLOCK_K]
    # vector, quantized once per tile (not once per weight row) and broadcast over the rows.
    # Pre-quantized (``fmaq``): loaded through the [BLOCK_N, BLOCK_K] broadcast pointer, as
    # the bf16 kernel's ``_x_row``, so x arrives in the weight tile's register layout (no
    # layout conversion through shared memory; a conversion per element, no rounding work).
    base = x_ptr + tl.minimum(row, M - 1).to(tl.int64) * stride_xm
    if PREQUANT:
        ptrs = base + zero_n[:, None] + ks[None, :]
        if EVEN_K:
            xv = tl.load(ptrs)
        else:
            xv = tl.load(ptrs, mask=(ks < K)[None, :], other=0.0)
        return xv.to(tl.float32)
    else:
        if EVEN_K:
            xv = tl.load(base + ks)
        else:
            xv = tl.load(base + ks, mask=ks < K, other=0.0)
        return _quantize(xv.to(tl.float32), scale).to(tl.float32)[None, :]


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
    x_ptr, xs_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, k_per_split,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_WS: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, VEC: tl.constexpr, PREQUANT: tl.constexpr,
):  # fmt: skip
    wait_for_inputs()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past N are clamped (loads stay unmasked along N; stores are masked).
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn
    w_scale = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)
    offs_k = tl.arange(0, BLOCK_K)
    zero_n = tl.zeros([BLOCK_N], dtype=tl.int32)
    s0 = _scale_of(x_ptr, xs_ptr, 0, M, stride_xm, K, BLOCK_K, PREQUANT)
    s1 = s0
    s2 = s0
    s3 = s0
    s4 = s0
    s5 = s0
    s6 = s0
    s7 = s0
    if ROWS > 1:
        s1 = _scale_of(x_ptr, xs_ptr, 1, M, stride_xm, K, BLOCK_K, PREQUANT)
    if ROWS > 2:
        s2 = _scale_of(x_ptr, xs_ptr, 2, M, stride_xm, K, BLOCK_K, PREQUANT)
        s3 = _scale_of(x_ptr, xs_ptr, 3, M, stride_xm, K, BLOCK_K, PREQUANT)
    if ROWS > 4:
        s4 = _scale_of(x_ptr, xs_ptr, 4, M, stride_xm, K, BLOCK_K, PREQUANT)
        s5 = _scale_of(x_ptr, xs_ptr, 5, M, stride_xm, K, BLOCK_K, PREQUANT)
        s6 = _scale_of(x_ptr, xs_ptr, 6, M, stride_xm, K, BLOCK_K, PREQUANT)
        s7 = _scale_of(x_ptr, xs_ptr, 7, M, stride_xm, K, BLOCK_K, PREQUANT)
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
        x0 = _xq_row(x_ptr, 0, s0, M, stride_xm, ks, zero_n, EVEN_K, K, PREQUANT)
        acc0 += _fold(w * x0, VEC)
        if ROWS > 1:
            x1 = _xq_row(x_ptr, 1, s1, M, stride_xm, ks, zero_n, EVEN_K, K, PREQUANT)
            acc1 += _fold(w * x1, VEC)
        if ROWS > 2:
            x2 = _xq_row(x_ptr, 2, s2, M, stride_xm, ks, zero_n, EVEN_K, K, PREQUANT)
            acc2 += _fold(w * x2, VEC)
            x3 = _xq_row(x_ptr, 3, s3, M, stride_xm, ks, zero_n, EVEN_K, K, PREQUANT)
            acc3 += _fold(w * x3, VEC)
        if ROWS > 4:
            x4 = _xq_row(x_ptr, 4, s4, M, stride_xm, ks, zero_n, EVEN_K, K, PREQUANT)
            acc4 += _fold(w * x4, VEC)
            x5 = _xq_row(x_ptr, 5, s5, M, stride_xm, ks, zero_n, EVEN_K, K, PREQUANT)
            acc5 += _fold(w * x5, VEC)
            x6 = _xq_row(x_ptr, 6, s6, M, stride_xm, ks, zero_n, EVEN_K, K, PREQUANT)
            acc6 += _fold(w * x6, VEC)
            x7 = _xq_row(x_ptr, 7, s7, M, stride_xm, ks, zero_n, EVEN_K, K, PREQUANT)
            acc7 += _fold(w * x7, VEC)
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


@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_dot_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_WS: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    PREQUANT: tl.constexpr,
):  # fmt: skip
    wait_for_inputs()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn
    # Padding rows (M..BLOCK_M) load zeros: they quantize to zero and are not stored.
    x_cols = x_ptr + tl.minimum(offs_m, M - 1).to(tl.int64)[None, :] * stride_xm
    m_ok = (offs_m < M)[None, :]
    if PREQUANT:
        x_scale = tl.load(xs_ptr + offs_m, mask=offs_m < M, other=1.0)
    else:
        amax = tl.zeros([BLOCK_K, BLOCK_M], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            ks = k + offs_k
            xv = tl.load(x_cols + ks[:, None], mask=(ks < K)[:, None] & m_ok, other=0.0)
            amax = tl.maximum(amax, tl.abs(xv.to(tl.float32)))
        x_scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k in range(k_start, k_start + k_per_split, BLOCK_K):
        ks = k + offs_k
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :], eviction_policy="evict_first")
            xt = tl.load(x_cols + ks[:, None], mask=m_ok, other=0.0)
        else:
            w = tl.load(
                w_rows + ks[None, :], mask=(ks < K)[None, :], other=0.0,
                eviction_policy="evict_first",
            )  # fmt: skip
            xt = tl.load(x_cols + ks[:, None], mask=(ks < K)[:, None] & m_ok, other=0.0)
        if not PREQUANT:
            xt = _quantize(xt.to(tl.float32), x_scale[None, :])
        acc = tl.dot(w, xt, acc, max_num_imprecise_acc=BLOCK_K)
    w_scale = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)
    acc = acc * w_scale[:, None] * x_scale[None, :]
    mask = (offs_n[:, None] < N) & m_ok
    if USE_WS:
        rows = (pid_k * M + offs_m).to(tl.int64)
        tl.store(ws_ptr + rows[None, :] * N + offs_n[:, None], acc, mask=mask)
    else:
        if HAS_BIAS:
            bias = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            acc += bias[:, None]
        out = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: GemvConfig,
    x_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[M, N] = fp8 scheme of x[M, K] @ weight[N, K].T (+ bias); ``config.kind`` one of
    ``KINDS``. ``x`` and ``weight`` need a unit stride along K, ``out`` along N. With
    ``x_scale`` [M, 1], x is already quantized (float8_e4m3fn): every kind then runs as
    its pre-quantized twin (``fma`` as ``fmaq``, ``dot`` as ``dotq``, same tiling)."""
    m, k = x.shape
    n = weight.shape[0]
    if m == 0 or n == 0:
        return out
    if k == 0 or config.kind not in KINDS or m > FMA_MAX_M:
        raise ValueError(f"unsupported FP8 GEMV case: M={m}, K={k}, {config.short()}")
    prequant = x_scale is not None or config.kind.endswith("q")
    if x_scale is not None:
        x_in = x
    elif prequant:
        x_in, x_scale = quantize_per_token(x)
    else:
        x_in, x_scale = x, out  # the scale argument is unused
    block_k = config.block_k
    split = max(1, min(config.split_k, triton.cdiv(k, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)  # no empty slices
    use_ws = split > 1
    workspace = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if use_ws else out
    bias_arg = bias if bias is not None else out
    grid = (triton.cdiv(n, config.block_n), split)
    common = (
        x_in, x_scale, weight, weight_scale, bias_arg, out, workspace,
        m, n, k, x_in.stride(0), weight.stride(0), out.stride(0), k_per_split,
    )  # fmt: skip
    if config.kind.startswith("fma"):
        _fp8_gemv_kernel[grid](
            *common,
            ROWS=_rows_bucket(m), BLOCK_N=config.block_n, BLOCK_K=block_k, USE_WS=use_ws,
            HAS_BIAS=bias is not None, EVEN_K=k % k_per_split == 0,
            VEC=min(16 // weight.element_size(), block_k), PREQUANT=prequant,
            num_warps=config.num_warps, num_stages=config.num_stages,
            launch_pdl=launch_pdl(out),
        )  # fmt: skip
    else:
        _fp8_gemv_dot_kernel[grid](
            *common,
            BLOCK_M=DOT_BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=block_k, USE_WS=use_ws,
            HAS_BIAS=bias is not None, EVEN_K=k % k_per_split == 0, PREQUANT=prequant,
            num_warps=config.num_warps, num_stages=config.num_stages,
            launch_pdl=launch_pdl(out),
        )  # fmt: skip
    if use_ws:
        reduce_splits(workspace, bias, out, split)
    return out


def fp8_linear(
    x: torch.Tensor | Fp8Activations,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``kernels.fp8_linear`` for x [..., K] (or pre-quantized); the caller checked
    eligibility."""
    if isinstance(x, Fp8Activations):
        source, x_scale = x.data, x.scale.reshape(-1, 1)
    else:
        source, x_scale = x, None
    rows = _rows(source)
    n = weight.shape[0]
    if out is None:
        out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=rows.device)
    launch(rows, weight, weight_scale, bias, out.view(rows.shape[0], n), config, x_scale)
    return out.view(*source.shape[:-1], n)
