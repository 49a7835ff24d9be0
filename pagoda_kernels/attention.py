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

Long prefills (``LongPrefill``: a sequence with many query tokens, found on the host by
``find_long_prefills``) may instead run FlashAttention-class kernels through torch's SDPA,
over their context gathered from the cache into contiguous K/V (a copy that costs little
beside the quadratic attention); the step's other sequences run the paged kernel. Such a
step runs eagerly: the split depends on host-side lengths that a CUDA graph cannot see.
"""

import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from pagoda_kernels._backend import kernel_for
from pagoda_kernels.kv_cache import dequantize_kv_ref, is_fp8_cache

logger = logging.getLogger(__name__)

# A sequence takes the SDPA path on a GPU (``long_prefill_min_queries``) with this many
# query tokens or more in a step and this many (query, key) pairs, its queries times its
# context: measured on an H100 (``benchmarks/long_prefill_check.py``, RESULTS.md), SDPA
# wins on every row from 2^25 pairs up (1.57-2.38x) and loses on 1k and 2k prompts from
# scratch (0.4-0.7x: the host work of the split and the eager step).
LONG_PREFILL_MIN_QUERIES = 2048
LONG_PREFILL_MIN_PAIRS = 1 << 25


@dataclass(frozen=True)
class LongPrefill:
    """A sequence of the step whose attention runs through SDPA: host-side integers."""

    seq: int  # its index among the step's sequences
    q_start: int  # its first query row
    num_queries: int
    context_len: int  # tokens of context, this step's included


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
    long_prefills: tuple[LongPrefill, ...] = (),
) -> torch.Tensor:
    """Dispatches to the Triton kernel (``pagoda_kernels/_triton/attention.py``) or the reference.

    The Triton path never syncs with the host, so it can be captured in a CUDA graph.
    ``long_prefills`` (in step order, from ``find_long_prefills``): sequences whose
    attention runs through SDPA instead (the result is the same math)."""
    if long_prefills:
        return _with_long_prefills(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
            k_scale, v_scale, long_prefills,
        )  # fmt: skip
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


def long_prefill_min_queries(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_size: int
) -> int | None:
    """From how many query tokens a sequence's prefill takes the SDPA path, for attention
    of this shape (one rank's heads) on ``device``: None where it does not (CPU, where the
    reference is the same math either way, or a GPU whose SDPA cannot run it without the
    math backend or gives another result: checked once per shape, ``_sdpa_mode``)."""
    if device.type != "cuda":
        return None
    if _sdpa_mode(device, dtype, num_heads, num_kv_heads, head_size) is None:
        return None
    return LONG_PREFILL_MIN_QUERIES


def find_long_prefills(
    query_start_loc: np.ndarray, seq_lens: np.ndarray, min_queries: int | None,
    min_pairs: int | None = None,
) -> tuple[LongPrefill, ...]:
    """The step's sequences of at least ``min_queries`` query tokens (none when None) and
    ``min_pairs`` (query, key) pairs (default ``LONG_PREFILL_MIN_PAIRS``), from the host's
    copies of ``query_start_loc`` and ``seq_lens``."""
    if min_queries is None:
        return ()
    min_pairs = LONG_PREFILL_MIN_PAIRS if min_pairs is None else min_pairs
    num_queries = np.diff(query_start_loc).astype(np.int64)
    chosen = (num_queries >= min_queries) & (num_queries * seq_lens >= min_pairs)
    return tuple(
        LongPrefill(int(b), int(query_start_loc[b]), int(num_queries[b]), int(seq_lens[b]))
        for b in np.flatnonzero(chosen)
    )


def _with_long_prefills(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out, k_scale, v_scale,
    long_prefills: tuple[LongPrefill, ...],
) -> torch.Tensor:  # fmt: skip
    """The paged op over the runs of sequences between the long prefills (their rows and
    ``query_start_loc`` rebased), SDPA for each long prefill."""
    if out is None:
        out = torch.empty_like(q)
    mode = _sdpa_mode(q.device, q.dtype, q.shape[1], k_cache.shape[2], q.shape[2])
    if mode is None:
        raise RuntimeError("long prefills given where SDPA cannot run them "
                           "(long_prefill_min_queries says where it can)")

    def paged(first_seq: int, end_seq: int, first_row: int, end_row: int) -> None:
        """The paged op over sequences [first_seq, end_seq), rows [first_row, end_row)."""
        if end_seq > first_seq and end_row > first_row:
            seqs, rows = slice(first_seq, end_seq), slice(first_row, end_row)
            paged_attention(
                q[rows], k_cache, v_cache, block_tables[seqs], seq_lens[seqs],
                query_start_loc[first_seq : end_seq + 1] - first_row, scale, out[rows],
                None, k_scale, v_scale,
            )  # fmt: skip

    first_seq, first_row = 0, 0
    for prefill in (*long_prefills, LongPrefill(seq_lens.shape[0], q.shape[0], 0, 0)):
        paged(first_seq, prefill.seq, first_row, prefill.q_start)
        if prefill.num_queries:
            rows = slice(prefill.q_start, prefill.q_start + prefill.num_queries)
            try:
                _sdpa_prefill(q[rows], k_cache, v_cache, block_tables[prefill.seq],
                              prefill.context_len, scale, k_scale, v_scale, out[rows], mode)
            except RuntimeError as error:  # a limit the start-up check's sizes did not meet
                _warn_once(f"SDPA failed on a long prefill ({prefill}), which runs the paged "
                           f"kernel instead: {error}")
                paged(prefill.seq, prefill.seq + 1, rows.start, rows.stop)
        first_seq, first_row = prefill.seq + 1, prefill.q_start + prefill.num_queries
    return out


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


@dataclass(frozen=True)
class _SdpaMode:
    """How SDPA runs long prefills of one shape on one device (``_sdpa_mode``)."""

    expand_kv: bool  # each KV head repeated for its query heads (SDPA without GQA)
    # A chunk over earlier context: "lower_right" is one SDPA call with the causal mask
    # aligned to the last key (torch gives it FlashAttention-2 only); "cudnn", "flash" and
    # "cpu" name the fused op that runs it as two calls, the earlier context unmasked and
    # the chunk over itself causal, merged by their log-sum-exps.
    over_context: str


def _sdpa_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    context_len: int, scale: float, k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None, out: torch.Tensor, mode: _SdpaMode,
) -> None:  # fmt: skip
    """One sequence's queries (its last ``len(q)`` tokens) over its ``context_len`` tokens
    of context: K/V gathered from the cache's blocks, causal aligned to the last key
    (a chunk or a prefix-cache hit sees all the context before it)."""
    from torch.nn.attention.bias import causal_lower_right

    num_queries, num_heads, _ = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    blocks = block_table[: -(-context_len // block_size)].long()
    keys = k_cache[blocks].flatten(0, 1)[:context_len]  # [S, Hkv, D]
    values = v_cache[blocks].flatten(0, 1)[:context_len]
    if is_fp8_cache(k_cache):
        keys = dequantize_kv_ref(keys, k_scale).to(q.dtype)
        values = dequantize_kv_ref(values, v_scale).to(q.dtype)
    if mode.expand_kv and num_heads != num_kv_heads:
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
    query = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
    key, value = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
    gqa = key.shape[1] != num_heads
    prefix = context_len - num_queries
    if prefix and mode.over_context != "lower_right":
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        before, lse_before = _attend(query, key[:, :, :prefix], value[:, :, :prefix], False,
                                     scale, mode.over_context)  # fmt: skip
        chunk, lse_chunk = _attend(query, key[:, :, prefix:], value[:, :, prefix:], True, scale,
                                   mode.over_context)  # fmt: skip
        top = torch.maximum(lse_before, lse_chunk)
        w_before, w_chunk = torch.exp(lse_before - top), torch.exp(lse_chunk - top)
        total = w_before + w_chunk
        result = (before.float() * (w_before / total)[..., None]
                  + chunk.float() * (w_chunk / total)[..., None])  # fmt: skip
    else:
        mask = causal_lower_right(num_queries, context_len) if prefix else None
        with _sdpa_backends(q.device):
            result = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, is_causal=mask is None, scale=scale,
                enable_gqa=gqa,
            )  # fmt: skip
    out.copy_(result[0].transpose(0, 1))


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float,
    op: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and its log-sum-exp per query row ([1, Hq, L] float32) from one of torch's
    fused SDPA ops (private ops: ``_sdpa_mode`` checks them before any step uses one)."""
    aten = torch.ops.aten
    if op == "cudnn":
        out, lse = aten._scaled_dot_product_cudnn_attention(
            query, key, value, None, True, 0.0, causal, False, scale=scale)[:2]
    elif op == "flash":
        out, lse = aten._scaled_dot_product_flash_attention(
            query, key, value, 0.0, causal, False, scale=scale)[:2]
    elif op == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, causal, scale=scale)[:2]
    else:
        raise ValueError(f"unknown SDPA op {op!r}")
    return out, lse.reshape(*lse.shape[:2], -1)[..., : query.shape[2]].float()


def _sdpa_backends(device: torch.device):
    """On a GPU never the math backend (it would materialise the [L, S] scores: gigabytes
    at long context); an SDPA that cannot run the call then raises instead."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device.type != "cuda":
        return nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                        SDPBackend.EFFICIENT_ATTENTION])


@functools.cache
def _sdpa_mode(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_size: int
) -> _SdpaMode | None:
    """How SDPA runs long prefills of this shape here: the first of the ways below that
    runs without the math backend and gives the reference's result on a chunk over earlier
    context and a prefill from scratch (None: none does, the paged kernel runs them).
    GPU: the chunk over context split in two around cuDNN's fused op, else
    FlashAttention's, else one lower-right call; each with the KV heads as they are, else
    expanded."""
    gen = torch.Generator(device=device).manual_seed(0)
    cache = torch.randn(4, 16, num_kv_heads, head_size, device=device, generator=gen)
    cache = cache.to(dtype)
    q = torch.randn(40, num_heads, head_size, device=device, generator=gen).to(dtype)
    table = torch.arange(4, device=device, dtype=torch.int32)
    scale = head_size**-0.5
    ways = ("cudnn", "flash", "lower_right") if device.type == "cuda" else ("cpu", "lower_right")
    expand = (False, True) if num_heads != num_kv_heads else (False,)
    for mode in (_SdpaMode(e, way) for way in ways for e in expand):
        try:
            for num_queries, context_len in ((24, 40), (40, 40)):
                out = torch.empty_like(q[:num_queries])
                _sdpa_prefill(q[:num_queries], cache, cache, table, context_len, scale, None,
                              None, out, mode)  # fmt: skip
                want = paged_attention_ref(
                    q[:num_queries], cache, cache, table[None],
                    torch.tensor([context_len], device=device),
                    torch.tensor([0, num_queries], device=device), scale,
                )  # fmt: skip
                if not torch.allclose(out.float(), want.float(), atol=2e-2, rtol=2e-2):
                    raise RuntimeError("the result differs from the reference")
        except (RuntimeError, NotImplementedError, ValueError) as error:
            logger.info("SDPA for long prefills (%s, %s): %s", dtype, mode, error)
            continue
        return mode
    logger.warning("long prefills (%s, %d/%d heads of %d) use the paged attention kernel: "
                   "SDPA cannot run them here", dtype, num_heads, num_kv_heads, head_size)
    return None
