"""Attention over a paged KV cache.

One op covers every case the scheduler produces: a prefill from scratch, a prefill
chunk on top of cached context (prefix cache hit or chunked prefill), and decode (one
query token). Sequence ``b`` owns query rows ``query_start_loc[b]:query_start_loc[b+1]``;
those are the *last* tokens of its ``seq_lens[b]`` tokens of context, whose keys and
values are already in the cache (written this step by ``write_kv_cache``). Attention is
causal within the context.

An FP8 cache (``kernels.kv_cache``) is read as its e4m3 values times ``k_scale`` /
``v_scale``; the kernel folds the key scale into the softmax scale and the value scale
into the output, which is the same math.
"""

import torch

from pagoda_kernels._backend import kernel_for
from pagoda_kernels.kv_cache import dequantize_kv_ref


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D]; caches: [num_blocks, block_size, Hkv, D];
    block_tables: [B, max_blocks] int32; seq_lens: [B] int32 (context length including
    this step's tokens); query_start_loc: [B + 1] int32. Returns [T, Hq, D].

    ``max_query_len`` is an optional hint (the longest query of the batch, known to the
    scheduler): kernels may use it to pick a tiling; it never changes the result.
    ``k_scale`` / ``v_scale``: one-element float32 tensors, the FP8 cache's scales (None:
    1.0; ignored for a cache in the model's dtype)."""
    num_heads, head_size = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, context_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        num_queries = q_end - q_start
        if num_queries == 0:
            continue
        num_blocks = (context_len + block_size - 1) // block_size
        blocks = block_tables[b, :num_blocks].long()
        keys = k_cache[blocks].reshape(-1, num_kv_heads, head_size)[:context_len]
        values = v_cache[blocks].reshape(-1, num_kv_heads, head_size)[:context_len]
        keys, values = dequantize_kv_ref(keys, k_scale), dequantize_kv_ref(values, v_scale)
        keys = keys.repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = values.repeat_interleave(group, dim=1)
        queries = q[q_start:q_end].float()  # [Lq, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        query_pos = torch.arange(context_len - num_queries, context_len, device=q.device)
        key_pos = torch.arange(context_len, device=q.device)
        mask = key_pos[None, :] > query_pos[:, None]
        scores.masked_fill_(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, values).to(out.dtype)
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatches to the Triton kernel (``pagoda_kernels/_triton/attention.py``) or the reference.

    The Triton path never syncs with the host, so it can be captured in a CUDA graph."""
    triton_ops = kernel_for("attention", q)
    if triton_ops is not None:
        return triton_ops.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
            max_query_len, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    return paged_attention_ref(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out, max_query_len,
        k_scale, v_scale,
    )  # fmt: skip


def warm_up_paged_attention(
    k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, scale: float,
    max_num_tokens: int, decode: bool, q_dtype: torch.dtype | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> list:
    """Compile every variant of the Triton kernel that a step of up to ``max_num_tokens``
    tokens (``decode``: of one query token per sequence) can pick, by launching each once on
    scratch queries; returns the tilings run (none where these caches use the reference).
    ``q_dtype``: the model's query dtype, needed when the cache is FP8."""
    triton_ops = kernel_for("attention", k_cache)
    if triton_ops is None:
        return []
    return triton_ops.warm_up(
        k_cache, v_cache, num_heads, scale, max_num_tokens, decode, q_dtype, k_scale, v_scale
    )
