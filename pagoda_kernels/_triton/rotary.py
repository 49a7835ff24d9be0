"""Triton rotary embedding (NeoX layout), optionally fused with the KV-cache write.

One program per token rotates all its query and key heads in place; the fused variant
also scatters the rotated key and the value into the paged cache, saving a launch and a
re-read of the keys per layer (an FP8 cache stores them quantized as ``write_kv_cache``
does: ``kernels._triton.kv_cache.store_kv``).
"""

import torch
import triton
import triton.language as tl

from pagoda_kernels._triton.kv_cache import scale_args, store_kv
from pagoda_kernels._triton.pdl import launch_pdl, wait_for_inputs


@triton.jit
def _rotate_heads(
    x_ptr, token, stride_t, stride_h, cos, sin,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    """Rotates one token's heads in place; returns the rotated halves and their pointers."""
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    first = x_ptr + token * stride_t + heads * stride_h + dims
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty)
    out2 = (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty)
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)
    return out1, out2, heads, dims, mask


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr,
    v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    stride_vt, stride_vh, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_Q_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    WRITE_CACHE: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    wait_for_inputs()
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    half_dims = tl.arange(0, HALF_PAD)[None, :]
    cs_mask = half_dims < HALF
    cos = tl.load(cos_sin_ptr + position * stride_cs + half_dims, mask=cs_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + position * stride_cs + HALF + half_dims, mask=cs_mask, other=0.0)
    _rotate_heads(
        q_ptr, token, stride_qt, stride_qh, cos, sin, NUM_Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD
    )
    k1, k2, heads, dims, mask = _rotate_heads(
        k_ptr, token, stride_kt, stride_kh, cos, sin, NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD
    )
    if WRITE_CACHE:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            block = slot // BLOCK_SIZE
            in_block = slot % BLOCK_SIZE
            k_dst = k_cache_ptr + block * stride_kcb + in_block * stride_kcs + heads * stride_kch
            k_dst += dims
            store_kv(k_dst, k1, k_scale_ptr, mask, KV_FP8)
            store_kv(k_dst + HALF, k2, k_scale_ptr, mask, KV_FP8)
            v_src = v_ptr + token * stride_vt + heads * stride_vh + dims
            v_dst = v_cache_ptr + block * stride_vcb + in_block * stride_vcs + heads * stride_vch
            v_dst += dims
            v1 = tl.load(v_src, mask=mask)
            v2 = tl.load(v_src + HALF, mask=mask)
            store_kv(v_dst, v1, v_scale_ptr, mask, KV_FP8)
            store_kv(v_dst + HALF, v2, v_scale_ptr, mask, KV_FP8)


def _launch(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    cache: tuple[torch.Tensor, ...] | None,
) -> None:
    num_tokens, num_q_heads, head_size = q.shape
    num_kv_heads = k.shape[1]
    for tensor in (q, k, cos_sin_cache):
        if tensor.stride(-1) != 1:
            raise ValueError("rotary_embedding needs the head dimension contiguous")
    if num_tokens == 0:
        return
    half = cos_sin_cache.shape[-1] // 2
    if cache is not None:
        v, k_cache, v_cache, slot_mapping, k_scale, v_scale = cache
        kv_fp8, k_scale, v_scale = scale_args(k_cache, v_cache, k_scale, v_scale)
        if v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
            raise ValueError("the KV-cache write needs the head dimension contiguous")
        v_strides = (v.stride(0), v.stride(1))
        kc_strides = k_cache.stride()[:3]
        vc_strides = v_cache.stride()[:3]
        block_size = k_cache.shape[1]
    else:
        v = k_cache = v_cache = slot_mapping = k_scale = v_scale = k  # never touched
        kv_fp8 = False
        v_strides, kc_strides, vc_strides, block_size = (0, 0), (0, 0, 0), (0, 0, 0), 1
    q_heads_pad = triton.next_power_of_2(num_q_heads)
    half_pad = triton.next_power_of_2(half)
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache,
        v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        *v_strides, *kc_strides, *vc_strides,
        NUM_Q_HEADS=num_q_heads, Q_HEADS_PAD=q_heads_pad,
        NUM_KV_HEADS=num_kv_heads, KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=half, HALF_PAD=half_pad, WRITE_CACHE=cache is not None, BLOCK_SIZE=block_size,
        KV_FP8=kv_fp8,
        num_warps=4 if q_heads_pad * half_pad >= 1024 else 1,
        launch_pdl=launch_pdl(q),
    )  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k in place and returns them."""
    _launch(positions, q, k, cos_sin_cache, None)
    return q, k


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
    """Rotates q and k in place, writes rotated k and v into the cache; returns (q, k)."""
    _launch(positions, q, k, cos_sin_cache,
            (v, k_cache, v_cache, slot_mapping, k_scale, v_scale))  # fmt: skip
    return q, k
