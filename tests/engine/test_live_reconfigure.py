"""Settings changed in a running engine, between steps (``inference.reconfigure``): requests
in flight finish with exactly the tokens they would have had, none fails, every KV block
comes back; a shrink preempts only what it must; graphs are captured before a larger batch
is used; what cannot be made live is refused, changing nothing."""

from __future__ import annotations

import itertools

import pytest
from tiny_models import build_tiny_model

from inference.config import EngineConfig
from inference.llm_engine import LLMEngine
from inference.reconfigure import ReconfigureError, live_settings
from inference.sampling_params import SamplingParams

BLOCK_SIZE = 8
MAX_MODEL_LEN = 96  # 12 blocks: the smallest cache a change may leave


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-live")
    build_tiny_model(path, "llama")
    return str(path)


def _engine(folder, **kwargs) -> LLMEngine:
    settings = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "num_kv_blocks": 64, **kwargs}
    return LLMEngine(EngineConfig(folder, device="cpu", max_model_len=MAX_MODEL_LEN,
                                  block_size=BLOCK_SIZE, seed=0, **settings))


PROMPTS = [[(7 * i + j) % 300 + 3 for j in range(5 + 3 * i)] for i in range(10)]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# (max_num_seqs, max_num_batched_tokens, num_kv_blocks): lower and higher than the start,
# small enough to force preemptions, a cache as small as one longest request.
CHANGES = [(2, 16, 40), (8, 64, 96), (1, 8, 12), (4, 32, 20), (6, 48, 64), (3, 12, 16),
           (8, 96, 128), (5, 5, 24)]  # fmt: skip


def _run(engine: LLMEngine, change_every: int | None = None, max_changes: int = 100):
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    outputs: dict[str, list[int]] = {}
    changes = itertools.cycle(CHANGES)
    steps = applied = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = list(out.outputs[0].token_ids)  # cumulative
            assert out.outputs[0].finish_reason in (None, "length")
        steps += 1
        if change_every and steps % change_every == 0 and applied < max_changes:
            seqs, tokens, blocks = next(changes)
            engine.reconfigure({"max_num_seqs": seqs, "max_num_batched_tokens": tokens,
                                "num_kv_blocks": blocks})  # fmt: skip
            applied += 1
            engine.block_manager.check_invariants(engine.scheduler.running)
    return outputs, applied


def test_outputs_unchanged_across_100_live_changes(folder):
    want, _ = _run(_engine(folder))
    engine = _engine(folder)
    got, applied = _run(engine, change_every=1)
    assert applied == 100  # one change after each of the first 100 steps
    assert got == want
    assert all(len(tokens) == GREEDY.max_tokens for tokens in got.values())
    assert engine.scheduler.num_preemptions > 0  # the small caches forced recomputes
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks == engine.num_total_blocks
    bm.check_invariants([])
    assert live_settings(engine) == {
        "max_num_seqs": engine.scheduler.max_num_seqs,
        "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
        "num_kv_blocks": bm.num_blocks, "gpu_memory_utilization": 0.9,
    }
    assert engine.runner.kv_caches[0][0].shape[0] == bm.num_blocks


def test_a_shrink_preempts_the_fewest_and_a_dry_run_changes_nothing(folder):
    engine = _engine(folder, num_kv_blocks=64)
    for i, prompt in enumerate(PROMPTS[:6]):
        engine.add_request(str(i), prompt, GREEDY)
    for _ in range(6):
        engine.step()
    used = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
    before = live_settings(engine)
    plan, _ = engine.reconfigure({"num_kv_blocks": 12}, dry_run=True)
    assert live_settings(engine) == before and engine.scheduler.num_preemptions == 0
    assert plan.kv_blocks == (64, 12) and 0 < plan.preemptions < 6
    plan_fit, _ = engine.reconfigure({"num_kv_blocks": used}, dry_run=True)
    assert plan_fit.preemptions == 0  # the free and cached blocks are enough
    applied, seconds = engine.reconfigure({"num_kv_blocks": 12})
    assert engine.scheduler.num_preemptions == applied.preemptions
    assert engine.block_manager.num_blocks == 12 and seconds < 5
    engine.block_manager.check_invariants(engine.scheduler.running)


@pytest.mark.parametrize("changes, status, words", [
    ({"max_num_seqs": 0}, 422, "integer >= 1"),
    ({"max_num_seqs": 32, "max_num_batched_tokens": 16}, 422, "must be >= max_num_seqs"),
    ({"num_kv_blocks": 4}, 422, "fewer than max_model_len"),
    ({"block_size": 16}, 422, "not a live setting"),
    ({"gpu_memory_utilization": 1.5}, 422, "(0, 1]"),
])  # fmt: skip
def test_refused_changes_say_why_and_change_nothing(folder, changes, status, words):
    engine = _engine(folder)
    before = live_settings(engine)
    with pytest.raises(ReconfigureError) as error:
        engine.reconfigure(changes)
    assert error.value.status == status and words in str(error.value)
    assert live_settings(engine) == before


class _GraphRunner:
    """The CPU runner, as if it had captured graphs up to (batch 8, 64 tokens): records
    each capture and the scheduler's limit when it ran."""

    def __init__(self, engine: LLMEngine) -> None:
        self._runner, self._engine = engine.runner, engine
        self.limits = (8, 64)
        self.captures: list[int] = []

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def graph_limits(self):
        return self.limits

    def set_batch_limits(self, max_num_seqs, max_num_batched_tokens):
        self._runner.set_batch_limits(max_num_seqs, max_num_batched_tokens)
        return max_num_seqs > self.limits[0]

    def capture_graphs(self) -> float:
        self.captures.append(self._engine.scheduler.max_num_seqs)
        self.limits = (self._runner.config.max_num_seqs, 64)
        return 0.0


def test_a_batch_past_the_captured_graphs_is_captured_before_it_is_used(folder):
    engine = _engine(folder)
    runner = engine.runner = _GraphRunner(engine)
    plan, _ = engine.reconfigure({"max_num_seqs": 4}, dry_run=True)
    assert plan.capture is None  # inside the captured sizes
    engine.reconfigure({"max_num_seqs": 4})
    assert runner.captures == []
    plan, _ = engine.reconfigure({"max_num_seqs": 16}, dry_run=True)
    assert plan.as_dict()["capture_needed"] and "past the largest graph" in plan.capture
    engine.reconfigure({"max_num_seqs": 16})
    assert runner.captures == [4]  # captured while the old limit was still in force
    assert engine.scheduler.max_num_seqs == 16 and runner.limits == (16, 64)
    plan, _ = engine.reconfigure({"num_kv_blocks": 80}, dry_run=True)
    assert "reallocated" in plan.capture  # graphs read the KV tensors
