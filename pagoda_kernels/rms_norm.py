"""RMSNorm, alone and fused with the residual add that precedes it.

The ``_fp8`` variants hand the normed rows to an FP8 projection already quantized
(``Fp8Activations``: the values ``rms_norm`` returns, quantized per token as
``kernels.fp8_quant`` does), written by the norm's own launch on the GPU instead of the
bf16 rows; the model asks for them only where the projection would otherwise quantize in a
launch of its own (``kernels.fp8_linear.wants_fp8_input``).
"""

import torch

from pagoda_kernels._backend import kernel_for
from pagoda_kernels.fp8_quant import Fp8Activations, quantize_as_activations

# Output dtypes the Triton FP8 variants round to (anything else takes the reference).
_FP8_SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H], weight: [H] -> [T, H]. Statistics in float32, as transformers does."""
    x32 = x.float()
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    normed = (x32 * torch.rsqrt(variance + eps)).to(x.dtype)
    return weight * normed


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    triton_ops = kernel_for("rms_norm", x)
    if triton_ops is not None:
        return triton_ops.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual). The Triton path stores the sum
    into ``residual`` in place (and returns it); use the returned pair, not the inputs."""
    triton_ops = kernel_for("rms_norm", x)
    if triton_ops is not None:
        return triton_ops.fused_add_rms_norm(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def rms_norm_fp8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Activations:
    """``rms_norm_ref``'s output quantized per token."""
    return quantize_as_activations(rms_norm_ref(x, weight, eps))


def fused_add_rms_norm_fp8_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[Fp8Activations, torch.Tensor]:
    """(rms_norm(x + residual) quantized per token, x + residual)."""
    normed, summed = fused_add_rms_norm_ref(x, residual, weight, eps)
    return quantize_as_activations(normed), summed


def _fp8_kernel(x: torch.Tensor, weight: torch.Tensor, sum_dtype: torch.dtype):
    triton_ops = kernel_for("rms_norm", x)
    if triton_ops is None or torch.promote_types(weight.dtype, sum_dtype) not in _FP8_SOURCE_DTYPES:
        return None
    return triton_ops


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Activations:
    """``rms_norm(x, weight, eps)`` as ``Fp8Activations`` (one launch on the GPU)."""
    triton_ops = _fp8_kernel(x, weight, x.dtype)
    if triton_ops is not None:
        return triton_ops.rms_norm_fp8(x, weight, eps)
    return rms_norm_fp8_ref(x, weight, eps)


def fused_add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[Fp8Activations, torch.Tensor]:
    """(rms_norm(x + residual) as ``Fp8Activations``, x + residual), one launch on the
    GPU; the sum is stored into ``residual`` in place there, as ``fused_add_rms_norm``."""
    triton_ops = _fp8_kernel(x, weight, torch.promote_types(x.dtype, residual.dtype))
    if triton_ops is not None:
        return triton_ops.fused_add_rms_norm_fp8(x, residual, weight, eps)
    return fused_add_rms_norm_fp8_ref(x, residual, weight, eps)
