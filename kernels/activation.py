"""SiLU-and-mul: the gated MLP activation, ``silu(x[..., :d]) * x[..., d:]``."""

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] (gate then up) -> [..., d]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_ref(x)
