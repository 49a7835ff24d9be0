"""KV-cache write: scatter this step's keys and values into their paged slots."""

import torch

from kernels._backend import kernel_for


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key, value: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D];
    slot_mapping: [T] int, slot = block_id * block_size + offset. A negative slot
    (padding) is skipped. Writes in place."""
    num_kv_heads, head_size = k_cache.shape[-2:]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_cache.view(-1, num_kv_heads, head_size)[slots] = key[valid].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_size)[slots] = value[valid].to(v_cache.dtype)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    triton_ops = kernel_for("kv_cache", key)
    if triton_ops is not None:
        triton_ops.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
        return
    write_kv_cache_ref(key, value, k_cache, v_cache, slot_mapping)
