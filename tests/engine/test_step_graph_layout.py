"""The layouts the CUDA step graphs replay (``pad_step_inputs``): a step padded to a
graph's bucket, with padding tokens and empty rows, gives its real rows the same hidden
states as the step run as it is. Checked on CPU with the eager model (the graphs themselves
run in tests/gpu)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import build_tiny_model

from inference.config import EngineConfig
from inference.layers.attention_metadata import AttentionMetadata
from inference.models.config import ModelConfig
from inference.runner.cuda_graphs import pad_step_inputs
from inference.runner.model_runner import ModelRunner
from inference.runner.step_inputs import StepInputs

BLOCK = 16


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    folder = tmp_path_factory.mktemp("llama")
    build_tiny_model(folder, "llama")
    config = EngineConfig.from_kwargs(
        str(folder), device="cpu", max_model_len=128, max_num_seqs=8,
        max_num_batched_tokens=64, num_kv_blocks=32,
    )  # fmt: skip
    model_config = ModelConfig.from_folder(folder)
    runner = ModelRunner(config.resolve(model_config), model_config, str(folder))
    runner.allocate_kv_cache(32)
    gen = torch.Generator().manual_seed(0)
    for k, v in runner.kv_caches:  # cached context for the sequences that have some
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    return runner


def step(query_lens: list[int], context_lens: list[int]) -> StepInputs:
    """Sequence i owns blocks 3i, 3i+1, 3i+2 and computes its last query_lens[i] tokens."""
    ids, positions, slots = [], [], []
    for i, (q, c) in enumerate(zip(query_lens, context_lens, strict=True)):
        for pos in range(c - q, c):
            ids.append(5 + 7 * i + pos)
            positions.append(pos)
            slots.append((3 * i + pos // BLOCK) * BLOCK + pos % BLOCK)
    return StepInputs(
        input_ids=np.array(ids, np.int64), positions=np.array(positions, np.int64),
        slot_mapping=np.array(slots, np.int64), seq_lens=np.array(context_lens, np.int32),
        query_start_loc=np.cumsum([0, *query_lens]).astype(np.int64),
        block_tables=np.arange(3 * len(query_lens), dtype=np.int32).reshape(-1, 3),
        max_query_len=max(query_lens),
    )  # fmt: skip


def run(runner: ModelRunner, ids, positions, slots, seq_lens, qsl, tables, max_q) -> torch.Tensor:
    meta = AttentionMetadata(
        slot_mapping=torch.as_tensor(slots), block_tables=torch.as_tensor(tables),
        seq_lens=torch.as_tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.as_tensor(qsl, dtype=torch.int32), max_query_len=max_q,
    )  # fmt: skip
    with torch.inference_mode():
        return runner.model(torch.as_tensor(ids), torch.as_tensor(positions),
                            runner.kv_caches, meta)  # fmt: skip


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "size", "rows"),
    [
        ([9, 1, 4], [9, 20, 30], 16, 9),  # mixed: prefill, decode, chunk on cached context
        ([16, 1], [40, 5], 32, 9),  # mixed, 15 padding tokens
        ([1, 1, 1], [3, 20, 33], 4, 4),  # decode, one padding row
    ],
)
def test_padded_step_matches_unpadded(runner, query_lens, context_lens, size, rows):
    inputs = step(query_lens, context_lens)
    n = len(inputs.input_ids)
    expected = run(runner, inputs.input_ids, inputs.positions, inputs.slot_mapping,
                   inputs.seq_lens, inputs.query_start_loc, inputs.block_tables,
                   inputs.max_query_len)  # fmt: skip
    tokens = np.full((3, size), 99, np.int64)  # stale values: all must be overwritten
    seqs = np.full((2, rows + 1), 99, np.int64)
    pad_step_inputs(inputs, size, rows, tokens, seqs)
    assert (tokens[2, n:] == -1).all(), "padding tokens must write nowhere"
    assert seqs[1, -1] == size and (np.diff(seqs[1]) >= 0).all()
    tables = np.zeros((rows, 3), np.int32)  # rows past the real ones: stale but valid
    tables[: inputs.num_seqs] = inputs.block_tables
    cache_before = [tensor.clone() for layer in runner.kv_caches for tensor in layer]
    got = run(runner, tokens[0], tokens[1], tokens[2], seqs[0, :rows], seqs[1], tables,
              1 if size == rows and inputs.max_query_len == 1 else size)  # fmt: skip
    assert got.shape[0] == size
    torch.testing.assert_close(got[:n], expected, rtol=1e-5, atol=1e-5)
    cache_after = [tensor for layer in runner.kv_caches for tensor in layer]
    check_cache_writes(cache_before, cache_after, inputs.slot_mapping)


def check_cache_writes(
    before: list[torch.Tensor], after: list[torch.Tensor], real_slots: np.ndarray
) -> None:
    """Every slot outside ``real_slots`` is bit-for-bit unchanged (padding writes nowhere);
    the real slots were rewritten by a batch of another shape, whose float results may
    differ in the last bits on another CPU or BLAS, so they are compared with a tolerance."""
    for old, new in zip(before, after, strict=True):
        old_slots, new_slots = old.flatten(0, 1), new.flatten(0, 1)  # [blocks * size, ...]
        written = torch.zeros(old_slots.shape[0], dtype=torch.bool)
        written[torch.as_tensor(real_slots)] = True
        assert torch.equal(old_slots[~written], new_slots[~written]), (
            "padding wrote into the KV cache"
        )
        torch.testing.assert_close(new_slots[written], old_slots[written], rtol=1e-5, atol=1e-5)


def test_cache_check_tolerates_real_slot_noise_and_catches_padding_writes():
    """The check itself: last-bit noise on the real slots passes, any padding write fails."""
    cache = torch.randn(4, BLOCK, 2, 8)
    real = np.array([0, 1, 17], np.int64)
    noisy = cache.clone().flatten(0, 1)
    noisy[real] = torch.nextafter(noisy[real], torch.full_like(noisy[real], float("inf")))
    check_cache_writes([cache], [noisy.view_as(cache)], real)
    stray = cache.clone().flatten(0, 1)
    stray[5, 0, 0] += 1.0
    with pytest.raises(AssertionError, match="padding wrote"):
        check_cache_writes([cache], [stray.view_as(cache)], real)
