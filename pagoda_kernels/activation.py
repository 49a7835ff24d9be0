"""SiLU-and-mul: the gated MLP activation, ``silu(x[..., :d]) * x[..., d:]``.

``silu_and_mul_fp8`` hands the result to an FP8 down projection already quantized
(``Fp8Activations``: ``silu_and_mul``'s values quantized per token as ``kernels.fp8_quant``
does), one launch on the GPU instead of two.
"""

import torch
import torch.nn.functional as F

from pagoda_kernels._backend import kernel_for
from pagoda_kernels.fp8_quant import Fp8Activations, quantize_as_activations


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] (gate then up) -> [..., d]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    triton_ops = kernel_for("activation", x)
    if triton_ops is not None:
        return triton_ops.silu_and_mul(x)
    return silu_and_mul_ref(x)


def silu_and_mul_fp8_ref(x: torch.Tensor) -> Fp8Activations:
    """``silu_and_mul_ref``'s output quantized per token."""
    return quantize_as_activations(silu_and_mul_ref(x))


def silu_and_mul_fp8(x: torch.Tensor) -> Fp8Activations:
    triton_ops = kernel_for("activation", x)
    if triton_ops is not None and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return triton_ops.silu_and_mul_fp8(x)
    return silu_and_mul_fp8_ref(x)
