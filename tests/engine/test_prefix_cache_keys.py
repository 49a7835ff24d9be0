"""Prefix-cache keys: SHA-256 chains rooted in what decides a block's KV, so neither a
64-bit hash collision nor another model or dtype can make two prefixes share blocks."""

from __future__ import annotations

import time

from inference.block_manager import BlockManager, hash_block, prefix_cache_root, token_bytes
from inference.sampling_params import SamplingParams
from inference.sequence import Sequence

BLOCK = 4


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, str(seq_id), 0, tokens, SamplingParams(max_tokens=4))


def run_prefill(bm: BlockManager, seq: Sequence) -> list[int]:
    """Look ``seq`` up, allocate and 'compute' it; returns the cached block ids it got."""
    cached = bm.find_cached_prefix(seq)
    assert bm.allocate(seq, seq.num_tokens - len(cached) * BLOCK, cached)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return cached


def test_parents_that_collided_under_the_old_hash_do_not_collide():
    # The old key was hash((parent_hash, tokens)): Python hashes ints modulo 2**61 - 1, so
    # two different parents congruent modulo it gave every child the same key, and the
    # lookup then compared only the child's own tokens: another prefix's KV was reused.
    tokens = (5, 6, 7, 8)
    parent_a = 123456789
    parent_b = parent_a + (2**61 - 1)
    assert hash((parent_a, tokens)) == hash((parent_b, tokens))  # the old scheme's collision
    digest_a = hash_block(parent_a.to_bytes(32, "little"), token_bytes(list(tokens)))
    digest_b = hash_block(parent_b.to_bytes(32, "little"), token_bytes(list(tokens)))
    assert digest_a != digest_b


def test_equal_blocks_after_different_prefixes_are_never_shared():
    bm = BlockManager(16, BLOCK)
    first = make_seq(0, [1, 2, 3, 4, 9, 9, 9, 9, 3])
    run_prefill(bm, first)
    # Same second block, different first block: nothing may be reused.
    assert bm.find_cached_prefix(make_seq(1, [1, 2, 3, 5, 9, 9, 9, 9, 3])) == []
    # The same prefix is found, block for block.
    assert bm.find_cached_prefix(make_seq(2, [1, 2, 3, 4, 9, 9, 9, 9, 4])) == first.block_table[:2]
    # A forced collision of the first block's digest is the only way to alias the second:
    # chained digests cover the whole prefix, not just the block's own tokens.
    third = make_seq(3, [1, 2, 3, 5, 9, 9, 9, 9, 3])
    bm._update_block_hashes(third)
    assert third.block_hashes[1] != first.block_hashes[1]
    bm.check_invariants([first])


def test_model_dtype_and_kv_dtype_are_part_of_the_key():
    base = dict(model="/models/a", load_format="auto", dtype="torch.float16",
                kv_cache_dtype="torch.float16")  # fmt: skip
    roots = {
        prefix_cache_root(**base),
        prefix_cache_root(**base | {"model": "/models/b"}),
        prefix_cache_root(**base | {"dtype": "torch.bfloat16"}),
        prefix_cache_root(**base | {"kv_cache_dtype": "torch.float8_e4m3fn"}),
        prefix_cache_root(**base | {"adapter": "sql-lora"}),
    }
    assert len(roots) == 5
    assert prefix_cache_root(**base) == prefix_cache_root(**dict(reversed(base.items())))
    tokens = list(range(BLOCK))
    managers = [BlockManager(8, BLOCK, root_hash=root) for root in sorted(roots)]
    source = make_seq(0, tokens + [0])
    run_prefill(managers[0], source)
    for other in managers[1:]:
        # The same tokens under another root: a different key (no shared index could mix them).
        probe = make_seq(1, tokens + [0])
        other._update_block_hashes(probe)
        assert probe.block_hashes[0] not in managers[0].hash_to_block_id


def test_engine_roots_its_chains_in_model_and_dtype(tmp_path):
    from tiny_models import build_tiny_model

    from inference.llm import LLM

    build_tiny_model(tmp_path, "llama")
    engine = LLM(str(tmp_path), device="cpu", max_model_len=64, num_kv_blocks=8).engine
    expected = prefix_cache_root(
        model=str(engine.model_path), load_format="auto", dtype="torch.float32",
        kv_cache_dtype="torch.float32", quantization=None,
    )  # fmt: skip
    assert engine.block_manager.root_hash == expected
    # What changes a block's KV changes the root: an FP8 KV cache, FP8 weights.
    for other in (dict(kv_cache_dtype="fp8"), dict(quantization="fp8")):
        variant = LLM(str(tmp_path), device="cpu", max_model_len=64, num_kv_blocks=8, **other)
        assert variant.engine.block_manager.root_hash != expected, other


def test_hashing_a_long_prompt_is_cheap():
    """100k tokens in 6,250 blocks: a few milliseconds (generous bound for a loaded box)."""
    bm = BlockManager(8, 16)
    seq = make_seq(0, [i % 50_000 for i in range(100_000)])
    start = time.perf_counter()
    bm._update_block_hashes(seq)
    elapsed = time.perf_counter() - start
    assert len(seq.block_hashes) == 6_250 and len(set(seq.block_hashes)) == 6_250
    assert elapsed < 1.0, elapsed
