"""KV-cache write: scatter this step's keys and values into their paged slots.

A cache is kept in the model's dtype, or in float8_e4m3fn (``kv_cache_dtype="fp8"``,
half the bytes). An FP8 cache holds ``value / scale`` saturated to +-448 (e4m3's largest
finite value) and rounded to nearest even, with one float32 scale per layer for the keys
and one for the values (``k_scale``, ``v_scale``: one-element tensors, so the scales live
on the device and a CUDA graph reads whatever they hold); attention multiplies them back.
Scales only apply to FP8 caches: a cache in the model's dtype ignores them.
"""

import torch

from pagoda_kernels._backend import kernel_for

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV_DTYPE


def quantize_kv_ref(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``x / scale`` (scale None: 1.0) in float32, saturated to +-448, cast to e4m3fn:
    what an FP8 cache stores for ``x``."""
    x = x.float()
    if scale is not None:
        x = x / scale.float()
    return x.clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def dequantize_kv_ref(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The float32 values a cache (or a gather of it) holds: FP8 entries times ``scale``;
    a cache in the model's dtype as it is."""
    values = cache.float()
    if is_fp8_cache(cache) and scale is not None:
        values = values * scale.float()
    return values


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """key, value: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D];
    slot_mapping: [T] int, slot = block_id * block_size + offset. A negative slot
    (padding) is skipped. Writes in place. FP8 caches store ``quantize_kv_ref`` of the
    inputs with ``k_scale`` / ``v_scale`` (None: 1.0)."""
    num_kv_heads, head_size = k_cache.shape[-2:]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        rows = x[valid]
        stored = quantize_kv_ref(rows, scale) if is_fp8_cache(cache) else rows.to(cache.dtype)
        cache.view(-1, num_kv_heads, head_size)[slots] = stored


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    triton_ops = kernel_for("kv_cache", key)
    if triton_ops is not None:
        triton_ops.write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    write_kv_cache_ref(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
