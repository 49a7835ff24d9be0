"""Triton skinny GEMM ("GEMV") for few-token decode: ``out = x @ weight.T + bias``.

At M <= 16 a projection is a pure weight stream (M x 2 x N x K FLOPs against 2 x N x K
bytes), so the kernel is built for bytes in flight, not for math:

- ``fma`` kernel (M <= 8): a program owns ``BLOCK_N`` weight rows x a K slice; each step
  loads a ``[BLOCK_N, BLOCK_K]`` tile with 16-byte loads along K (the weight is K-contiguous)
  and ``evict_first``, and does elementwise float32 FMAs into one ``[BLOCK_N, BLOCK_K]``
  accumulator per token row (up to ``ROWS`` = 1, 2, 4 or 8 rows, written out explicitly);
  the K reduction happens once, after the loop. Small ``BLOCK_N`` (1..8 rows) gives
  hundreds to thousands of programs even for N = 1536, so most shapes need no split-K.
- ``dot`` kernel (any M, padded to ``BLOCK_M`` >= 16): ``tl.dot(w_tile, x_tile^T)`` with the
  weight as the MMA's M side, pipelined through shared memory (``num_stages``).

With ``SPLIT_K > 1`` each K slice writes float32 partials to a workspace and a second,
tiny kernel sums them in a fixed order, adds the bias and casts: deterministic (no atomics),
and nothing depends on the host besides shapes, so the op captures in a CUDA graph.
"""

import torch
import triton
import triton.language as tl

from pagoda_kernels._gemv_table import FMA_MAX_M, GemvConfig
from pagoda_kernels._triton.pdl import launch_pdl, wait_for_inputs


@triton.jit
def _x_row(x_ptr, row, M, stride_xm, ks, zero_n, EVEN_K: tl.constexpr, K):
    # Rows past M are clamped to M - 1: loads stay unmasked, their results are not stored.
    # The [BLOCK_N, BLOCK_K] broadcast pointer gives x the weight tile's register layout
    # (each thread loads the x elements it multiplies, from L1), so no layout conversion
    # through shared memory is needed in the loop.
    r = tl.minimum(row, M - 1).to(tl.int64)
    ptrs = x_ptr + r * stride_xm + zero_n[:, None] + ks[None, :]
    if EVEN_K:
        xv = tl.load(ptrs)
    else:
        xv = tl.load(ptrs, mask=(ks < K)[None, :], other=0.0)
    return xv.to(tl.float32)


@triton.jit
def _fold(prod, VEC: tl.constexpr):
    # [BLOCK_N, BLOCK_K] -> [BLOCK_N, BLOCK_K // VEC]: sums each thread's own VEC-wide
    # K run (the width of one 16-byte load), so the accumulators take VEC x fewer registers.
    if VEC == 1:
        return prod
    n: tl.constexpr = prod.shape[0]
    k: tl.constexpr = prod.shape[1]
    return tl.sum(tl.reshape(prod, [n, k // VEC, VEC]), axis=2)


@triton.jit
def _store_row(
    acc, row, pid_k, out_ptr, ws_ptr, b_ptr, offs_n, M, N, stride_om,
    HAS_BIAS: tl.constexpr, USE_WS: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    total = tl.sum(acc, axis=1)
    mask = (offs_n < N) & (row < M)
    if GATED:  # tile rows are [gate rows; up rows]: store silu(gate) * up
        gate, up = tl.split(tl.permute(tl.reshape(total, [2, BLOCK_N]), [1, 0]))
        total = gate / (1.0 + tl.exp(-gate)) * up
    if USE_WS:
        tl.store(ws_ptr + (pid_k * M + row).to(tl.int64) * N + offs_n, total, mask=mask)
    else:
        if HAS_BIAS:
            total += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _gemv_fma_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, k_per_split,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_WS: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, VEC: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    wait_for_inputs()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if GATED:
        # 2 x BLOCK_N weight rows: gate rows n, then up rows N + n (weight is [2N, K]).
        TILE_N: tl.constexpr = 2 * BLOCK_N
        offs_t = tl.arange(0, TILE_N)
        tile_n = pid_n * BLOCK_N + offs_t % BLOCK_N
        w_row = tl.minimum(tile_n, N - 1) + (offs_t // BLOCK_N) * N
    else:
        TILE_N: tl.constexpr = BLOCK_N
        # Rows past N are clamped (loads stay unmasked along N; stores are masked).
        w_row = tl.minimum(offs_n, N - 1)
    w_rows = w_ptr + w_row.to(tl.int64)[:, None] * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    zero_n = tl.zeros([TILE_N], dtype=tl.int32)
    acc0 = tl.zeros([TILE_N, BLOCK_K // VEC], dtype=tl.float32)
    acc1 = tl.zeros([TILE_N, BLOCK_K // VEC], dtype=tl.float32)
    acc2 = tl.zeros([TILE_N, BLOCK_K // VEC], dtype=tl.float32)
    acc3 = tl.zeros([TILE_N, BLOCK_K // VEC], dtype=tl.float32)
    acc4 = tl.zeros([TILE_N, BLOCK_K // VEC], dtype=tl.float32)
    acc5 = tl.zeros([TILE_N, BLOCK_K // VEC], dtype=tl.float32)
    acc6 = tl.zeros([TILE_N, BLOCK_K // VEC], dtype=tl.float32)
    acc7 = tl.zeros([TILE_N, BLOCK_K // VEC], dtype=tl.float32)
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
        acc0 += _fold(w * _x_row(x_ptr, 0, M, stride_xm, ks, zero_n, EVEN_K, K), VEC)
        if ROWS > 1:
            acc1 += _fold(w * _x_row(x_ptr, 1, M, stride_xm, ks, zero_n, EVEN_K, K), VEC)
        if ROWS > 2:
            acc2 += _fold(w * _x_row(x_ptr, 2, M, stride_xm, ks, zero_n, EVEN_K, K), VEC)
            acc3 += _fold(w * _x_row(x_ptr, 3, M, stride_xm, ks, zero_n, EVEN_K, K), VEC)
        if ROWS > 4:
            acc4 += _fold(w * _x_row(x_ptr, 4, M, stride_xm, ks, zero_n, EVEN_K, K), VEC)
            acc5 += _fold(w * _x_row(x_ptr, 5, M, stride_xm, ks, zero_n, EVEN_K, K), VEC)
            acc6 += _fold(w * _x_row(x_ptr, 6, M, stride_xm, ks, zero_n, EVEN_K, K), VEC)
            acc7 += _fold(w * _x_row(x_ptr, 7, M, stride_xm, ks, zero_n, EVEN_K, K), VEC)
    _store_row(acc0, 0, pid_k, out_ptr, ws_ptr, b_ptr, offs_n, M, N, stride_om,
               HAS_BIAS, USE_WS, GATED, BLOCK_N)  # fmt: skip
    if ROWS > 1:
        _store_row(acc1, 1, pid_k, out_ptr, ws_ptr, b_ptr, offs_n, M, N, stride_om,
                   HAS_BIAS, USE_WS, GATED, BLOCK_N)  # fmt: skip
    if ROWS > 2:
        _store_row(acc2, 2, pid_k, out_ptr, ws_ptr, b_ptr, offs_n, M, N, stride_om,
                   HAS_BIAS, USE_WS, GATED, BLOCK_N)  # fmt: skip
        _store_row(acc3, 3, pid_k, out_ptr, ws_ptr, b_ptr, offs_n, M, N, stride_om,
                   HAS_BIAS, USE_WS, GATED, BLOCK_N)  # fmt: skip
    if ROWS > 4:
        _store_row(acc4, 4, pid_k, out_ptr, ws_ptr, b_ptr, offs_n, M, N, stride_om,
                   HAS_BIAS, USE_WS, GATED, BLOCK_N)  # fmt: skip
        _store_row(acc5, 5, pid_k, out_ptr, ws_ptr, b_ptr, offs_n, M, N, stride_om,
                   HAS_BIAS, USE_WS, GATED, BLOCK_N)  # fmt: skip
        _store_row(acc6, 6, pid_k, out_ptr, ws_ptr, b_ptr, offs_n, M, N, stride_om,
                   HAS_BIAS, USE_WS, GATED, BLOCK_N)  # fmt: skip
        _store_row(acc7, 7, pid_k, out_ptr, ws_ptr, b_ptr, offs_n, M, N, stride_om,
                   HAS_BIAS, USE_WS, GATED, BLOCK_N)  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _gemv_dot_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_WS: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    wait_for_inputs()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn
    x_cols = x_ptr + tl.minimum(offs_m, M - 1).to(tl.int64)[None, :] * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k in range(k_start, k_start + k_per_split, BLOCK_K):
        ks = k + offs_k
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :], eviction_policy="evict_first")
            xt = tl.load(x_cols + ks[:, None])
        else:
            w = tl.load(
                w_rows + ks[None, :], mask=(ks < K)[None, :], other=0.0,
                eviction_policy="evict_first",
            )  # fmt: skip
            xt = tl.load(x_cols + ks[:, None], mask=(ks < K)[:, None], other=0.0)
        acc = tl.dot(w, xt, acc, input_precision=PRECISION)
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    if USE_WS:
        rows = (pid_k * M + offs_m).to(tl.int64)
        tl.store(ws_ptr + rows[None, :] * N + offs_n[:, None], acc, mask=mask)
    else:
        if HAS_BIAS:
            bias = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            acc += bias[:, None]
        out = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce_kernel(
    ws_ptr, b_ptr, out_ptr, M, N, stride_om, split_k,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    wait_for_inputs()
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(split_k):  # a fixed order: deterministic
        total += tl.load(ws_ptr + (s * M + row).to(tl.int64) * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        total += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def _rows_bucket(m: int) -> int:
    return 1 if m <= 1 else 2 if m <= 2 else 4 if m <= 4 else 8


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: GemvConfig,
    gated: bool = False,
) -> torch.Tensor:
    """out[M, N] = x[M, K] @ weight[N, K].T (+ bias). ``x`` and ``weight`` need a unit
    stride along K, ``out`` along N. ``gated``: weight is [2N, K] (gate rows, then up rows)
    and out = silu(x @ gate.T) * (x @ up.T), fma kernel only, no bias, no split-K."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if m == 0 or n == 0:
        return out
    if k == 0 or (gated and (config.kind != "fma" or bias is not None)):
        raise ValueError("unsupported GEMV case")
    block_k = config.block_k
    split = 1 if gated else max(1, min(config.split_k, triton.cdiv(k, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)  # no empty slices
    even_k = k % k_per_split == 0
    use_ws = split > 1
    workspace = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if use_ws else out
    grid = (triton.cdiv(n, config.block_n), split)
    common = (
        x, weight, bias if bias is not None else out, out, workspace,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_per_split,
    )  # fmt: skip
    if config.kind == "fma":
        if m > FMA_MAX_M:
            raise ValueError(f"the fma GEMV kernel takes at most {FMA_MAX_M} rows, got {m}")
        _gemv_fma_kernel[grid](
            *common,
            ROWS=_rows_bucket(m), BLOCK_N=config.block_n, BLOCK_K=block_k, USE_WS=use_ws,
            HAS_BIAS=bias is not None, EVEN_K=even_k, VEC=min(16 // x.element_size(), block_k),
            GATED=gated, num_warps=config.num_warps, num_stages=config.num_stages,
            launch_pdl=launch_pdl(out),
        )  # fmt: skip
    else:
        _gemv_dot_kernel[grid](
            *common,
            BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=config.block_n,
            BLOCK_K=block_k, USE_WS=use_ws, HAS_BIAS=bias is not None, EVEN_K=even_k,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=config.num_warps, num_stages=config.num_stages,
            launch_pdl=launch_pdl(out),
        )  # fmt: skip
    if use_ws:
        reduce_splits(workspace, bias, out, split)
    return out


def reduce_splits(workspace: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                  split: int) -> None:  # fmt: skip
    """out [M, N] = the sum of a split-K GEMV's ``split`` float32 partials [split, M, N],
    in a fixed order (+ bias)."""
    m, n = out.shape
    block = min(1024, triton.next_power_of_2(n))
    _splitk_reduce_kernel[(m, triton.cdiv(n, block))](
        workspace, out if bias is None else bias, out, m, n, out.stride(0), split,
        HAS_BIAS=bias is not None, BLOCK=block, num_warps=4 if block >= 512 else 1,
        launch_pdl=launch_pdl(out),
    )  # fmt: skip


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear`` semantics for x [..., K]; the caller checked eligibility (and that
    ``out``, if given, is contiguous with M x N elements)."""
    rows = _rows(x)
    if out is None:
        out = torch.empty((rows.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    launch(rows, weight, bias, out.view(rows.shape[0], weight.shape[0]), config)
    return out.view(*x.shape[:-1], weight.shape[0])


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig) -> torch.Tensor:
    """``silu_and_mul(F.linear(x, weight))`` in one pass (weight [2I, K] -> out [..., I])."""
    rows = _rows(x)
    width = weight.shape[0] // 2
    out = torch.empty((rows.shape[0], width), dtype=x.dtype, device=x.device)
    launch(rows, weight, None, out, config, gated=True)
    return out.view(*x.shape[:-1], width)
