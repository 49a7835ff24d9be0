"""Rotary tables: the cos/sin cache the rotary kernel reads, with Llama 3's scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


def _default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths are slowed by ``factor``,
    short ones kept, and the band between is interpolated smoothly."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def build_cos_sin_cache(
    head_dim: int,
    max_position: int,
    theta: float,
    scaling: dict[str, Any] | None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """[max_position, head_dim] float32: cos of each angle, then sin."""
    inv_freq = _default_inv_freq(head_dim, theta)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type != "default":
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
        )
    positions = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
