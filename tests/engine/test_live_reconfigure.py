"""Settings changed in a running engine, between steps (``inference.reconfigure``): requests
in flight finish with exactly the tokens they would have had, none fails, every KV block
comes back; a shrink preempts only what it must; graphs are captured before a larger batch
is used, in the background while steps go on under the old limits, and a failed capture
refuses the change; what cannot be made live is refused, changing nothing."""

from __future__ import annotations

import itertools
import threading
import time

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


# -- graphs captured in the background (``start_change``, ``finish_change``) ---------------

DEADLINE_S = 120.0  # generous: the box may be loaded; nothing here waits for it unless broken


class _BackgroundCapture:
    """Graphs "recorded" on the capture thread: ``run`` returns once ``release`` is set
    (raising ``fail`` then, if given), or raises once cancelled; ``install`` switches the
    runner's limits and records the scheduler's limit at that moment."""

    def __init__(self, runner: _GraphRunner, limits: tuple[int, int], fail=None) -> None:
        self.runner, self.limits, self.fail = runner, limits, fail
        self.num_graphs = 3
        self.started, self.release, self.cancelled = (threading.Event() for _ in range(3))
        self.stopped = threading.Event()
        self.ignore_cancel = False

    def run(self) -> None:
        self.started.set()
        try:
            deadline = time.monotonic() + DEADLINE_S
            while not self.release.wait(0.01):
                if self.cancelled.is_set() and not self.ignore_cancel:
                    raise RuntimeError("cancelled")
                assert time.monotonic() < deadline, "the test never released the capture"
            if self.fail is not None:
                raise self.fail
        finally:
            self.stopped.set()

    def cancel(self) -> None:
        self.cancelled.set()

    def install(self) -> None:
        self.runner.installs.append(self.runner._engine.scheduler.max_num_seqs)
        self.runner.limits = self.limits


class _BackgroundRunner(_GraphRunner):
    """``_GraphRunner`` whose missing graphs are recorded in the background."""

    def __init__(self, engine: LLMEngine, fail=None) -> None:
        super().__init__(engine)
        self.fail = fail
        self.installs: list[int] = []
        self.pending: list[_BackgroundCapture] = []

    def set_batch_limits(self, max_num_seqs, max_num_batched_tokens):
        self._runner.set_batch_limits(max_num_seqs, max_num_batched_tokens)
        return False  # the sampled-ids buffer has room: the graphs there are stay

    def capture_missing_graphs(self, max_num_seqs, max_num_batched_tokens):
        capture = _BackgroundCapture(self, (max_num_seqs, max(max_num_batched_tokens, 64)),
                                     self.fail)  # fmt: skip
        self.pending.append(capture)
        return capture


def _wait(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _add_all(engine: LLMEngine, prompts=PROMPTS) -> None:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)


def _collect(outputs: dict[str, list[int]], step_outputs) -> None:
    for out in step_outputs:
        outputs[out.request_id] = list(out.outputs[0].token_ids)


def test_steps_go_on_under_the_old_limits_while_graphs_are_captured(folder):
    reference = _engine(folder, max_num_seqs=2)
    want, _ = _run(reference)
    engine = _engine(folder, max_num_seqs=2)
    runner = engine.runner = _BackgroundRunner(engine)
    runner.limits = (2, 64)
    _add_all(engine)
    got: dict[str, list[int]] = {}
    for _ in range(3):
        _collect(got, engine.step())
    change = engine.begin_reconfigure({"max_num_seqs": 8})
    assert not change.done and change.plan.background_graphs == 3
    capture = runner.pending[0]
    _wait(capture.started.is_set, "the capture thread to start")
    # The capture runs on its own thread; the engine steps meanwhile, at the old limit.
    tokens_before = sum(map(len, got.values()))
    for _ in range(10):
        _collect(got, engine.step())
        assert len(engine.scheduler.running) <= 2 and engine.scheduler.max_num_seqs == 2
    assert sum(map(len, got.values())) > tokens_before + 10  # 10 steps' tokens came out
    assert not change.done and live_settings(engine)["max_num_seqs"] == 2
    capture.release.set()
    _wait(lambda: change.captured, "the capture to finish")
    _collect(got, engine.step())  # the first step boundary after it: the change is made
    assert change.done and runner.installs == [2]  # installed before the new limit was used
    plan, seconds = change.result()
    assert plan.after["max_num_seqs"] == 8 and seconds > 0
    assert engine.scheduler.max_num_seqs == 8 and runner.limits == (8, 64)
    assert len(engine.scheduler.running) > 2  # the raised limit is in use
    while engine.has_unfinished_requests():
        _collect(got, engine.step())
    assert got == want  # nothing in flight was lost or changed
    engine.block_manager.check_invariants([])


def test_a_failed_capture_refuses_the_change_and_leaves_the_engine_as_it_was(folder):
    want, _ = _run(_engine(folder, max_num_seqs=2))
    engine = _engine(folder, max_num_seqs=2)
    runner = engine.runner = _BackgroundRunner(engine, fail=RuntimeError("out of memory"))
    runner.limits = (2, 64)
    _add_all(engine)
    got: dict[str, list[int]] = {}
    _collect(got, engine.step())
    before = live_settings(engine)
    change = engine.begin_reconfigure({"max_num_seqs": 8, "max_num_batched_tokens": 32})
    runner.pending[0].release.set()
    _wait(lambda: change.captured, "the capture to fail")
    _collect(got, engine.step())
    assert change.done
    with pytest.raises(ReconfigureError) as error:
        change.result()
    assert error.value.status == 409 and "out of memory" in str(error.value)
    assert "nothing was changed" in str(error.value)
    assert live_settings(engine) == before and runner.installs == [] and runner.limits == (2, 64)
    while engine.has_unfinished_requests():
        _collect(got, engine.step())
    assert got == want
    engine.reconfigure({"max_num_seqs": 1})  # the engine still takes changes
    assert engine.scheduler.max_num_seqs == 1
    # A failure preparing the capture (its buffers, warm-up runs) refuses it as well.
    runner.capture_missing_graphs = lambda *limits: _raise(RuntimeError("CUDA out of memory"))
    with pytest.raises(ReconfigureError) as error:
        engine.begin_reconfigure({"max_num_seqs": 8})
    assert error.value.status == 409 and "CUDA out of memory" in str(error.value)
    assert engine.scheduler.max_num_seqs == 1 and engine._live_change is None


def _raise(error: Exception):
    raise error


def test_a_second_change_during_a_capture_is_refused_and_a_dry_run_answered(folder):
    engine = _engine(folder, max_num_seqs=2)
    runner = engine.runner = _BackgroundRunner(engine)
    runner.limits = (2, 64)
    change = engine.begin_reconfigure({"max_num_seqs": 8})
    with pytest.raises(ReconfigureError) as error:
        engine.begin_reconfigure({"max_num_seqs": 1})
    assert error.value.status == 409 and "under way" in str(error.value)
    plan, _ = engine.reconfigure({"num_kv_blocks": 32}, dry_run=True)
    assert plan.kv_blocks == (64, 32)
    runner.pending[0].release.set()
    _wait(lambda: change.captured, "the capture to finish")
    engine.step()  # idle: the step boundary still makes the change
    assert change.done and engine.scheduler.max_num_seqs == 8
    # The blocking form (the step loop waits): made once its capture is done.
    threading.Timer(0.2, lambda: runner.pending[-1].release.set()).start()
    plan, _ = engine.reconfigure({"max_num_seqs": 16, "max_num_batched_tokens": 64})
    assert engine.scheduler.max_num_seqs == 16 and runner.limits == (16, 64)
    assert len(runner.pending) == 2


@pytest.mark.parametrize("ignore_cancel", [False, True])
def test_a_shutdown_during_a_capture_does_not_hang(folder, monkeypatch, ignore_cancel):
    monkeypatch.setattr("inference.reconfigure.CANCEL_WAIT_S", 0.5)
    engine = _engine(folder, max_num_seqs=2)
    runner = engine.runner = _BackgroundRunner(engine)
    runner.limits = (2, 64)
    _add_all(engine, PROMPTS[:3])
    engine.step()
    change = engine.begin_reconfigure({"max_num_seqs": 8})
    capture = runner.pending[0]
    capture.ignore_cancel = ignore_cancel
    _wait(capture.started.is_set, "the capture thread to start")
    start = time.monotonic()
    engine.shutdown()
    assert time.monotonic() - start < DEADLINE_S / 2
    assert capture.cancelled.is_set() and not change.done
    if not ignore_cancel:
        assert capture.stopped.wait(DEADLINE_S)  # it stopped between graphs
    capture.release.set()  # (the stuck one ends with the test)


def test_only_the_missing_graphs_are_recorded():
    from inference.runner.cuda_graphs import graph_sizes, missing_shapes, mixed_rows

    batches, tokens = graph_sizes(256, 8192)
    have = {("decode", b): b for b in batches} | {("mixed", t): mixed_rows(256) for t in tokens}
    assert len(have) == 34
    missing = missing_shapes(have, 512, 8192)
    # Four larger batches; the mixed steps past 256 tokens may now hold more sequences than
    # their graphs have rows; the smaller ones hold at most their token count.
    assert [s for k, s in missing if k == "decode"] == [512, 448, 384, 320]
    assert [s for k, s in missing if k == "mixed"] == [t for t in reversed(tokens) if t > 256]
    assert missing_shapes(have, 128, 8192) == missing_shapes(have, 256, 8192) == []
    batches, tokens = graph_sizes(64, 512)
    have = {("decode", b): b for b in batches} | {("mixed", t): mixed_rows(64) for t in tokens}
    assert missing_shapes(have, 64, 2048) == [
        ("mixed", t) for t in (2048, 1792, 1536, 1280, 1024, 896, 768, 640, 576)
    ]


def test_parts_sized_at_start_up_refuse_what_they_cannot_follow(folder):
    """A drafter's KV cache mirrors the target's block ids and LoRA's slot buffers hold the
    start-up step: a change past them is a 409 that names the part, and changes nothing
    (a grown target cache would hand the drafter block ids past its end)."""
    draft = {"method": "draft_model", "model": folder, "num_speculative_tokens": 2}
    engine = _engine(folder, speculative_config=draft)
    before = live_settings(engine)
    with pytest.raises(ReconfigureError) as error:
        engine.reconfigure({"num_kv_blocks": 96})
    assert error.value.status == 409 and "drafter's KV cache" in str(error.value)
    assert live_settings(engine) == before
    engine.reconfigure({"max_num_seqs": 4})  # the batch limits still change live
    assert live_settings(engine)["max_num_seqs"] == 4

    engine = _engine(folder, enable_lora=True, max_loras=1, max_lora_rank=8)
    before = live_settings(engine)
    with pytest.raises(ReconfigureError) as error:
        engine.reconfigure({"max_num_batched_tokens": 96})
    assert error.value.status == 409 and "LoRA's per-token buffers hold steps of 64" in str(
        error.value
    )
    assert live_settings(engine) == before
    engine.reconfigure({"max_num_batched_tokens": 32, "num_kv_blocks": 96})
    assert live_settings(engine)["max_num_batched_tokens"] == 32
