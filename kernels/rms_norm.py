"""RMSNorm, alone and fused with the residual add that precedes it."""

import torch


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
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return fused_add_rms_norm_ref(x, residual, weight, eps)
