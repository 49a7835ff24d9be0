"""SiLU-and-mul: the gated MLP activation, ``silu(x[..., :d]) * x[..., d:]``."""

import torch
import torch.nn.functional as F

from kernels._backend import kernel_for


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] (gate then up) -> [..., d]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    triton_ops = kernel_for("activation", x)
    if triton_ops is not None:
        return triton_ops.silu_and_mul(x)
    return silu_and_mul_ref(x)
