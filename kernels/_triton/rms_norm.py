"""Triton RMSNorm and residual-add + RMSNorm: one program per row, statistics in float32."""

import torch
import triton
import triton.language as tl

from kernels._triton.pdl import launch_pdl, wait_for_inputs


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
    result = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, result.to(out_ptr.dtype.element_ty), mask=mask)


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
    block = triton.next_power_of_2(hidden)
    num_warps = 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out,
        summed if summed is not None else out,
        x.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0), summed.stride(0) if summed is not None else 0, eps,
        HIDDEN=hidden, BLOCK=block, ADD_RESIDUAL=residual is not None,
        num_warps=num_warps,
        launch_pdl=launch_pdl(x),
    )  # fmt: skip


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
