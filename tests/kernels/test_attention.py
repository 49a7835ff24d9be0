"""Paged attention: Triton kernel vs the float32 reference and a float64 ground truth."""

import pytest
import torch

from pagoda_kernels import paged_attention, paged_attention_ref
from pagoda_kernels._float64 import attention64, rel_err

# Relative error bounds (norm-wise) against the float64 truth, per storage dtype.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    padding_tokens: int = 0,
) -> dict[str, torch.Tensor]:
    """Random q and caches; each sequence's blocks are scattered over a shuffled pool."""
    max_blocks = max(-(-length // block_size) for length in context_lens)
    num_blocks = len(context_lens) * max_blocks + 2
    pool = torch.randperm(num_blocks)[: len(context_lens) * max_blocks]
    num_tokens = sum(query_lens) + padding_tokens
    cumulative = torch.tensor([0, *query_lens]).cumsum(0)
    return {
        "q": torch.randn(num_tokens, num_heads, head_size).to(dtype),
        "k_cache": torch.randn(num_blocks, block_size, num_kv_heads, head_size).to(dtype),
        "v_cache": torch.randn(num_blocks, block_size, num_kv_heads, head_size).to(dtype),
        "block_tables": pool.view(len(context_lens), max_blocks).to(torch.int32),
        "seq_lens": torch.tensor(context_lens, dtype=torch.int32),
        "query_start_loc": cumulative.to(torch.int32),
    }


def check(batch: dict[str, torch.Tensor], dtype: torch.dtype, **overrides: int) -> None:
    from pagoda_kernels._triton import attention as triton_attention

    scale = batch["q"].shape[-1] ** -0.5
    covered = int(batch["query_start_loc"][-1])
    poisoned = torch.full_like(batch["q"], float("nan"))
    if overrides:
        out = triton_attention.paged_attention(**batch, scale=scale, out=poisoned, **overrides)
    else:
        out = paged_attention(**batch, scale=scale, out=poisoned)
    assert out.data_ptr() == poisoned.data_ptr()
    out = out[:covered]
    assert not out.isnan().any(), "kernel left output rows unwritten"
    truth = attention64(**batch, scale=scale)[:covered]
    reference = paged_attention_ref(**batch, scale=scale)[:covered]
    assert rel_err(out, truth) <= TOLERANCE[dtype]
    assert rel_err(reference, truth) <= TOLERANCE[dtype]
    assert rel_err(out, reference) <= 2 * TOLERANCE[dtype]


MIXES = {
    # name: (query lengths, context lengths)
    "decode": ([1, 1, 1, 1], [1, 17, 40, 70]),
    "prefill": ([19, 5], [19, 5]),
    "chunked": ([8, 3], [40, 20]),
    "mixed": ([1, 12, 1, 0, 5], [33, 12, 2, 9, 30]),
}


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_mixes_and_block_sizes(mix: str, block_size: int) -> None:
    torch.manual_seed(block_size + len(mix))
    query_lens, context_lens = MIXES[mix]
    batch = make_batch(query_lens, context_lens, 4, 2, 64, block_size, torch.float32)
    check(batch, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_size"), [(6, 2, 128), (2, 2, 64)])
def test_dtypes_heads_and_gqa(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_size: int
) -> None:
    torch.manual_seed(num_heads * head_size)
    batch = make_batch([1, 9, 1], [24, 30, 7], num_heads, num_kv_heads, head_size, 16, dtype)
    check(batch, dtype)


@pytest.mark.parametrize("num_segments", [2, 8])
@pytest.mark.parametrize("block_size", [1, 16])
def test_split_kv_decode(num_segments: int, block_size: int) -> None:
    """Flash-decoding: segments, some of them empty, merged by the second kernel."""
    torch.manual_seed(num_segments)
    batch = make_batch([1, 1, 1], [3, 50, 90], 8, 2, 64, block_size, torch.bfloat16)
    check(batch, torch.bfloat16, num_segments=num_segments, tile_n=16)


def test_split_kv_prefill_chunk() -> None:
    torch.manual_seed(1)
    batch = make_batch([10, 1], [60, 33], 4, 1, 64, 16, torch.float32)
    check(batch, torch.float32, num_segments=4, block_m=16, tile_n=16)


@pytest.mark.parametrize("num_segments", [64, 128])
def test_many_segments_merged_in_chunks(num_segments: int) -> None:
    """Long-context decode at batch 1 splits the KV range into up to 256 segments; the merge
    reads their partials in chunks (most of them empty here)."""
    torch.manual_seed(num_segments)
    batch = make_batch([1, 1], [3, 700], 3, 1, 64, 16, torch.float32)
    check(batch, torch.float32, num_segments=num_segments, tile_n=16)


@pytest.mark.parametrize(("num_segments", "tile_n", "block_m"),
                         [(1, 16, 16), (4, 16, 16), (2, 32, 16), (1, 64, 128)])  # fmt: skip
def test_whole_tiles_then_the_diagonal(num_segments: int, tile_n: int, block_m: int) -> None:
    """Tiles that every row of a query block sees whole skip the masks; the diagonal and
    the segment's partial last tile keep them: chunks starting mid-tile, segments
    starting before and after a block's first query, a prompt shorter than a tile."""
    torch.manual_seed(num_segments * tile_n)
    batch = make_batch([20, 37, 5, 1], [150, 37, 5, 77], 4, 2, 64, 16, torch.float32)
    check(batch, torch.float32, num_segments=num_segments, block_m=block_m, tile_n=tile_n)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "num_segments", "dtype"),
                         [(6, 2, 1, torch.float32), (7, 1, 2, torch.float32),
                          (6, 2, 1, torch.bfloat16), (4, 4, 1, torch.float32)])  # fmt: skip
def test_one_query_head_a_program(
    num_heads: int, num_kv_heads: int, num_segments: int, dtype: torch.dtype
) -> None:
    """Prefill tiles of one query head (no padded GQA rows): groups of 6 and 7 (not powers
    of two), no GQA, a split KV range, chunks starting mid-tile and a one-token query."""
    from pagoda_kernels._triton import attention as triton_attention

    tiling = triton_attention.choose_tiling(64, 4, num_heads, num_kv_heads, 64, None,
                                            torch.device("cpu"), per_head=True)  # fmt: skip
    assert tiling.per_head and tiling.block_q == tiling.block_m == 64
    torch.manual_seed(num_heads * 10 + num_segments)
    batch = make_batch([20, 37, 5, 1], [150, 37, 5, 77], num_heads, num_kv_heads, 64, 16, dtype)
    check(batch, dtype, per_head=True, num_segments=num_segments, block_m=16, tile_n=16)
    check(batch, dtype, per_head=True, num_segments=num_segments)


def test_padding_tokens_and_hint() -> None:
    """Rows past the last sequence (CUDA-graph padding) are left alone; a hint changes
    only the tiling."""
    torch.manual_seed(2)
    batch = make_batch([1, 1], [20, 9], 4, 2, 64, 16, torch.float32, padding_tokens=2)
    check(batch, torch.float32)
    check(batch, torch.float32, max_query_len=1)
    check(batch, torch.float32, max_query_len=4)


def test_head_size_32_and_256() -> None:
    for head_size in (32, 256):
        torch.manual_seed(head_size)
        batch = make_batch([3, 1], [10, 21], 4, 2, head_size, 16, torch.float32)
        check(batch, torch.float32)


@pytest.mark.parametrize("num_segments", [1, 4])
def test_mixed_graph_layout(num_segments: int) -> None:
    """A mixed step as its CUDA graph lays it out: the real sequences, one sequence made of
    the padding tokens, then empty rows (no queries, no context) up to the graph's width.
    The real rows come out as without the padding."""
    torch.manual_seed(5 + num_segments)
    query_lens, context_lens = [1, 12, 1, 5], [33, 12, 2, 30]
    real = make_batch(query_lens, context_lens, 4, 2, 64, 16, torch.float32)
    padded = make_batch([*query_lens, 3, 0, 0, 0], [*context_lens, 3, 0, 0, 0], 4, 2, 64, 16,
                        torch.float32)  # fmt: skip
    for name in ("k_cache", "v_cache"):
        padded[name] = real[name]
    padded["block_tables"][: len(query_lens)] = real["block_tables"]
    padded["block_tables"][len(query_lens) :] = 0  # stale but valid ids, as in a graph
    padded["q"][: real["q"].shape[0]] = real["q"]
    scale = 64**-0.5
    from pagoda_kernels._triton import attention as triton_attention

    out = triton_attention.paged_attention(
        **padded, scale=scale, max_query_len=19, num_segments=num_segments
    )
    expected = paged_attention_ref(**real, scale=scale)
    assert rel_err(out[: real["q"].shape[0]], expected) <= 2 * TOLERANCE[torch.float32]


def test_a_mixed_graphs_spare_rows_do_not_count_against_splitting(monkeypatch) -> None:
    """A mixed step's graph holds a row for every sequence the scheduler may batch (1025),
    but a step of 16 tokens has at most 16 with queries: its tiling splits the KV range as
    for 16 sequences, so a speculative verify step (one sequence, k + 1 tokens, a long
    context) replayed in that graph does not walk the whole context on one program per KV
    head. (Counting the spare rows gave one segment.)"""
    from pagoda_kernels._triton import attention as triton_attention

    monkeypatch.setattr(triton_attention, "num_sms", lambda device: 132)
    device = torch.device("cuda")  # only its type is read, for the SM count above
    graph = triton_attention.choose_tiling(16, 1025, 12, 2, 128, 16, device)
    assert graph == triton_attention.choose_tiling(16, 16, 12, 2, 128, 16, device)
    assert graph.num_segments >= 8
    warmed = triton_attention.tilings(12, 2, 128, 2048, device, decode=False)
    assert graph in warmed  # compiled before the engine reports ready
