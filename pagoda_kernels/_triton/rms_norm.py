"""Triton RMSNorm and residual-add + RMSNorm: one program per row, statistics in float32.

The ``_fp8`` variants write the normed row as ``kernels.fp8_linear``'s pre-quantized input
(float8_e4m3fn values and a float32 scale a token) instead of the row itself: the values
are those ``rms_norm`` would store (rounded to its output dtype), quantized as
``kernels.fp8_quant`` does, so the next FP8 projection needs no quantization launch."""

import torch
import triton
import triton.language as tl

from pagoda_kernels._triton.fp8_quant import fp8_scale, to_fp8
from pagoda_kernels._triton.pdl import launch_pdl, wait_for_inputs
from pagoda_kernels.fp8_quant import FP8_DTYPE, Fp8Activations

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _normed_row(
    x_ptr, residual_ptr, weight_ptr, summed_ptr, row, stride_x, stride_r, stride_s, eps,
    cols, mask, HIDDEN: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
):  # fmt: skip
    # Row ``row`` normalised and times the weight, in float32 (masked lanes are zero);
    # with ADD_RESIDUAL, x + residual is stored into ``summed`` first.
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # Round the sum to the residual stream's dtype first: the reference normalises
        # the rounded sum, and the next layer adds to exactly this value.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(summed_ptr.dtype.element_ty)
        tl.store(summed_ptr + row * stride_s + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / HIDDEN
    normed = (x32 * tl.math.rsqrt(variance + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    return normed.to(tl.float32) * weight.to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, summed_ptr,
    stride_x, stride_r, stride_o, stride_s, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    result = _normed_row(
        x_ptr, residual_ptr, weight_ptr, summed_ptr, row, stride_x, stride_r, stride_s, eps,
        cols, mask, HIDDEN, ADD_RESIDUAL,
    )  # fmt: skip
    tl.store(out_ptr + row * stride_o + cols, result.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_fp8_kernel(
    x_ptr, residual_ptr, weight_ptr, q_ptr, qs_ptr, summed_ptr,
    stride_x, stride_r, stride_q, stride_s, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):  # fmt: skip
    # The same row, quantized as ``kernels.fp8_quant`` would quantize the normed output:
    # rounded to the output dtype first, then its amax, scale and e4m3 values (the row is
    # in registers already: one more reduction, no second pass).
    wait_for_inputs()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    result = _normed_row(
        x_ptr, residual_ptr, weight_ptr, summed_ptr, row, stride_x, stride_r, stride_s, eps,
        cols, mask, HIDDEN, ADD_RESIDUAL,
    )  # fmt: skip
    result = result.to(OUT_DTYPE).to(tl.float32)
    scale = fp8_scale(tl.max(tl.abs(result), axis=0))
    tl.store(q_ptr + row * stride_q + cols, to_fp8(result, scale), mask=mask)
    tl.store(qs_ptr + row, scale)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    summed: torch.Tensor | None,
) -> None:
    hidden = x.shape[-1]
    rows = x.numel() // hidden if hidden else 0
    if rows == 0:
        return
    block, num_warps = _block(hidden)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out,
        summed if summed is not None else out,
        x.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0), summed.stride(0) if summed is not None else 0, eps,
        HIDDEN=hidden, BLOCK=block, ADD_RESIDUAL=residual is not None,
        num_warps=num_warps,
        launch_pdl=launch_pdl(x),
    )  # fmt: skip


def _block(hidden: int) -> tuple[int, int]:
    """(block, warps): the whole row in one block, spread over more warps as it grows."""
    block = triton.next_power_of_2(hidden)
    return block, 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16


def _launch_fp8(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype,
    summed: torch.Tensor | None,
) -> Fp8Activations:
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    hidden = x.shape[-1]
    if x.shape[0] and hidden:
        block, num_warps = _block(hidden)
        _rms_norm_fp8_kernel[(x.shape[0],)](
            x, residual if residual is not None else x, weight, q, scale,
            summed if summed is not None else x,
            x.stride(0), residual.stride(0) if residual is not None else 0,
            q.stride(0), summed.stride(0) if summed is not None else 0, eps,
            HIDDEN=hidden, BLOCK=block, ADD_RESIDUAL=residual is not None,
            OUT_DTYPE=TL_DTYPES[out_dtype], num_warps=num_warps,
            launch_pdl=launch_pdl(x),
        )  # fmt: skip
    return Fp8Activations(q, scale, out_dtype)


def _as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """[..., H] as [rows, H] with a unit column stride (a view when possible)."""
    rows = tensor.reshape(-1, tensor.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x_rows = _as_rows(x)
    out = torch.empty(
        x_rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device
    )
    _launch(x_rows, None, weight, eps, out, None)
    return out.view(*x.shape[:-1], x.shape[-1])


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes ``x + residual`` into ``residual`` in place when dtypes and layout allow
    (the usual case), saving an allocation per layer; returns (normed, summed)."""
    sum_dtype = torch.promote_types(x.dtype, residual.dtype)
    x_rows = _as_rows(x)
    residual_rows = _as_rows(residual)
    in_place = residual.dtype == sum_dtype and residual_rows.data_ptr() == residual.data_ptr()
    summed = residual_rows if in_place else torch.empty_like(residual_rows, dtype=sum_dtype)
    out = torch.empty(
        x_rows.shape, dtype=torch.promote_types(weight.dtype, sum_dtype), device=x.device
    )
    _launch(x_rows, residual_rows, weight, eps, out, summed)
    shape = x.shape
    return out.view(shape), (residual if in_place else summed.view(shape))


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Activations:
    x_rows = _as_rows(x)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    return _shaped(_launch_fp8(x_rows, None, weight, eps, out_dtype, None), x.shape)


def fused_add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[Fp8Activations, torch.Tensor]:
    """``fused_add_rms_norm`` (the sum into ``residual`` in place when possible) with the
    normed rows written as fp8 values and scales only."""
    sum_dtype = torch.promote_types(x.dtype, residual.dtype)
    x_rows = _as_rows(x)
    residual_rows = _as_rows(residual)
    in_place = residual.dtype == sum_dtype and residual_rows.data_ptr() == residual.data_ptr()
    summed = residual_rows if in_place else torch.empty_like(residual_rows, dtype=sum_dtype)
    out_dtype = torch.promote_types(weight.dtype, sum_dtype)
    quantized = _launch_fp8(x_rows, residual_rows, weight, eps, out_dtype, summed)
    shape = x.shape
    return _shaped(quantized, shape), (residual if in_place else summed.view(shape))


def _shaped(quantized: Fp8Activations, shape: torch.Size) -> Fp8Activations:
    return Fp8Activations(quantized.data.view(shape), quantized.scale.view(*shape[:-1], 1),
                          quantized.dtype)  # fmt: skip
