"""Triton KV-cache write: one program per token scatters its keys and values (into an
FP8 cache as ``value / scale`` saturated to +-448, see ``kernels.kv_cache``)."""

import functools

import torch
import triton
import triton.language as tl

from pagoda_kernels._triton.pdl import launch_pdl, wait_for_inputs
from pagoda_kernels.kv_cache import FP8_KV_DTYPE, FP8_KV_MAX

FP8_MAX = tl.constexpr(FP8_KV_MAX)


@triton.jit
def store_kv(dst_ptr, x, scale_ptr, mask, KV_FP8: tl.constexpr):
    """Store ``x`` into a cache: cast to its dtype, or for an FP8 cache divided by the
    scale in float32, saturated to +-448 (e4m3 has no infinity) and rounded to e4m3."""
    if KV_FP8:
        scaled = x.to(tl.float32) / tl.load(scale_ptr)
        scaled = tl.minimum(tl.maximum(scaled, -FP8_MAX), FP8_MAX)
        tl.store(dst_ptr, scaled.to(dst_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(dst_ptr, x.to(dst_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _unit_scale(device: torch.device) -> torch.Tensor:
    # Made once per device: never inside a CUDA-graph capture after the first launch.
    return torch.ones(1, dtype=torch.float32, device=device)


def scale_args(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale, v_scale):
    """(KV_FP8, k_scale, v_scale) for a launch: for an FP8 cache the scales as given (None:
    1.0), else placeholders that are never read."""
    kv_fp8 = k_cache.dtype == FP8_KV_DTYPE
    if kv_fp8 != (v_cache.dtype == FP8_KV_DTYPE):
        raise ValueError("the key and value caches must both be FP8 or neither")
    if not kv_fp8:
        return False, k_cache, v_cache
    one = _unit_scale(k_cache.device)
    return True, one if k_scale is None else k_scale, one if v_scale is None else v_scale


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
):  # fmt: skip
    wait_for_inputs()
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_SIZE)
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + in_block * stride_kcs + heads * stride_kch + dims
    v_dst = v_cache_ptr + block * stride_vcb + in_block * stride_vcs + heads * stride_vch + dims
    store_kv(k_dst, k, k_scale_ptr, mask, KV_FP8)
    store_kv(v_dst, v, v_scale_ptr, mask, KV_FP8)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    num_tokens = key.shape[0]
    _, block_size, num_kv_heads, head_size = k_cache.shape
    if num_tokens == 0:
        return
    for tensor in (key, value, k_cache, v_cache):
        if tensor.stride(-1) != 1:
            raise ValueError("write_kv_cache needs the head dimension contiguous")
    heads_pad = triton.next_power_of_2(num_kv_heads)
    head_pad = triton.next_power_of_2(head_size)
    kv_fp8, k_scale, v_scale = scale_args(k_cache, v_cache, k_scale, v_scale)
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=heads_pad,
        HEAD_SIZE=head_size, HEAD_PAD=head_pad, BLOCK_SIZE=block_size, KV_FP8=kv_fp8,
        num_warps=1 if heads_pad * head_pad <= 256 else 4,
        launch_pdl=launch_pdl(key),
    )  # fmt: skip
