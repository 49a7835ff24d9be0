"""Rotary embedding fused with the KV-cache write: rotate q and k, then store the rotated
keys and the values into their paged slots, in one pass (one launch per layer fewer, and
the keys are not read back from memory). An FP8 cache gets the rotated keys and the
values quantized with ``k_scale`` / ``v_scale`` as ``write_kv_cache`` does."""

import torch

from pagoda_kernels._backend import kernel_for
from pagoda_kernels.kv_cache import write_kv_cache_ref
from pagoda_kernels.rotary import rotary_embedding_ref


def rotary_embedding_with_kv_cache_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T]; q [T, Hq, D]; k, v [T, Hkv, D]; cos_sin_cache as for
    ``rotary_embedding``; caches and slot_mapping as for ``write_kv_cache`` (slot -1 is
    skipped), ``k_scale`` / ``v_scale`` as for ``write_kv_cache`` (FP8 caches only).
    Returns the rotated (q, k); the cache receives rotated k and v."""
    q_rot, k_rot = rotary_embedding_ref(positions, q, k, cos_sin_cache)
    write_kv_cache_ref(k_rot, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q_rot, k_rot


def rotary_embedding_with_kv_cache(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton path rotates q and k in place and returns them; use the returned pair."""
    triton_ops = kernel_for("rotary", q)
    if triton_ops is not None:
        return triton_ops.rotary_embedding_with_kv_cache(
            positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale
        )
    return rotary_embedding_with_kv_cache_ref(
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale
    )
