"""The KV cache: its size in bytes and its FP8 scales (``kv_cache_dtype``; the torch dtype
is ``ResolvedEngineConfig.kv_cache_torch_dtype``).

``auto`` keeps keys and values in the model's dtype. ``fp8`` stores them as
float8_e4m3fn (one byte an element: twice the tokens in the same memory) as
``value / scale``, saturated to +-448, with one float32 scale per layer for the keys and
one for the values (``kernels.kv_cache``). The scales come from the checkpoint where it
has them, under vLLM's names (``self_attn.k_scale`` / ``v_scale``, the older single
``kv_scale``, vLLM's own ``self_attn.attn.k_scale``, or the ``k_proj.output_scale`` /
``v_proj.output_scale`` of compressed-tensors and ModelOpt exports), else 1.0, vLLM's
default: then keys and values are stored as they are, and any beyond +-448 clip.
"""

from __future__ import annotations

import math

import torch

# Checkpoint tensor-name suffixes (after "self_attn.") -> which scale they set.
_SCALE_NAMES = {
    "k_scale": "k", "v_scale": "v", "kv_scale": "kv",
    "attn.k_scale": "k", "attn.v_scale": "v", "attn.kv_scale": "kv",
    "k_proj.output_scale": "k", "v_proj.output_scale": "v",
}  # fmt: skip


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                   cache_dtype: torch.dtype) -> int:  # fmt: skip
    """Bytes of one block across all layers, keys and values."""
    element = torch.tensor([], dtype=cache_dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def kv_scale_kind(attention_leaf: str) -> str | None:
    """"k", "v" or "kv" (both) if a tensor name's part after ``self_attn.`` is a KV-cache
    scale, else None."""
    return _SCALE_NAMES.get(attention_leaf)


def check_kv_scale(name: str, tensor: torch.Tensor) -> float:
    """The scale a checkpoint tensor holds (one element), checked: positive and finite."""
    if tensor.numel() != 1:
        raise ValueError(f"{name}: a KV-cache scale is one number per layer, got shape "
                         f"{tuple(tensor.shape)} (per-head scales are not supported)")  # fmt: skip
    value = float(tensor.float().item())
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name}: KV-cache scale must be positive and finite, got {value}")
    return value
