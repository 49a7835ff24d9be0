"""AsyncLLMEngine without HTTP: streaming, abort on close, errors, readiness, shutdown.

The engine runs in a child process that takes seconds to start, so the tests that leave it
usable share one, on an event loop in a background thread."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from inference.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineNotReadyError,
    QueueFullError,
    RequestAbortedError,
)
from inference.config import EngineConfig
from inference.sampling_params import SamplingParams

LONG = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


def make(tiny_model, **kwargs) -> AsyncLLMEngine:
    config = EngineConfig(model=tiny_model, device="cpu", num_kv_blocks=64, max_num_seqs=4)
    return AsyncLLMEngine(config, **kwargs)


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def shared(tiny_model):
    """(loop, engine): one started engine for the tests that leave it idle and healthy."""
    loop = LoopThread()
    engine = make(tiny_model)

    async def start() -> None:
        assert not engine.ready
        engine.start()
        assert engine.health_problem is None
        await engine.wait_ready()

    loop.run(start())
    yield loop, engine
    loop.run(engine.shutdown(1))
    assert not engine.ready
    loop.close()


async def wait_idle(engine: AsyncLLMEngine) -> None:
    total = engine.stats.num_total_blocks
    for _ in range(400):
        stats = engine.stats
        if stats.num_free_blocks == total and stats.num_running + stats.num_waiting == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"engine not idle: {engine.stats}")


def test_streams_cumulative_outputs_then_finishes(shared):
    loop, engine = shared

    async def scenario():
        assert engine.ready and engine.health_problem is None
        params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
        lengths = []
        async for output in engine.generate("The quick brown fox", params, "r1"):
            lengths.append(len(output.outputs[0].token_ids))
        assert output.finished and output.outputs[0].finish_reason == "length"
        assert lengths == sorted(lengths) and lengths[-1] == 8
        assert len(lengths) == len(set(lengths)), "one output per step, each with a new token"

    loop.run(scenario())


def test_deltas_add_up_and_never_show_a_cut_stop_string(shared):
    loop, engine = shared
    greedy = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)

    async def scenario():
        outputs = [o async for o in engine.generate("hi there", greedy)]
        full = outputs[-1].outputs[0]
        deltas = [o async for o in engine.generate("hi there", greedy, delta=True)]
        # One token a step; steps that queue up while the reader lags go out as one delta.
        assert all(d.outputs[0].token_ids for d in deltas)
        assert sum((d.outputs[0].token_ids for d in deltas), []) == full.token_ids
        assert "".join(d.outputs[0].text for d in deltas) == full.text
        assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"
        # A 3-character stop string from the middle of that text: the streamed deltas must
        # add up to the text before it, and never have shown its first characters.
        text = full.text
        start = next(
            i for i in range(3, len(text) - 3)
            if text.find(text[i : i + 3]) == i and text[i : i + 3].strip()
        )  # fmt: skip
        stop = text[start : start + 3]
        params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0, stop=[stop])
        deltas = [o async for o in engine.generate("hi there", params, delta=True)]
        assert "".join(d.outputs[0].text for d in deltas) == text[:start]
        assert deltas[-1].outputs[0].finish_reason == "stop"
        assert deltas[-1].outputs[0].stop_reason == stop

    loop.run(scenario())


def test_a_lagging_reader_gets_the_queued_steps_as_one_delta(shared):
    """Deltas queued while the reader was away are merged: one output with all their
    tokens, text and logprobs, the finish with them (what the SSE stream then writes once)."""
    loop, engine = shared
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, logprobs=2, n=2,
                            seed=3)  # fmt: skip

    async def scenario():
        full = [o async for o in engine.generate("hi there", params)][-1]
        stream = engine.generate("hi there", params, delta=True)
        first = await anext(stream)
        await wait_idle(engine)  # every other step is queued now
        rest = [o async for o in stream]
        assert len(rest) == 1 and rest[0].finished
        for completion in full.outputs:
            parts = [c for o in (first, rest[0]) for c in o.outputs if c.index == completion.index]
            assert sum((c.token_ids for c in parts), []) == completion.token_ids
            assert "".join(c.text for c in parts) == completion.text
            logprobs = sum((c.logprobs for c in parts), [])
            assert [sorted(e) for e in logprobs] == [sorted(e) for e in completion.logprobs]
            assert parts[-1].finish_reason == "length"
            assert parts[-1].cumulative_logprob == pytest.approx(completion.cumulative_logprob)

    loop.run(scenario())


def test_closing_the_stream_aborts_and_frees_blocks(shared):
    loop, engine = shared

    async def scenario():
        total = engine.stats.num_total_blocks
        stream = engine.generate("The quick brown fox", LONG, "r1")
        await anext(stream)
        await stream.aclose()
        for _ in range(400):
            if engine.stats.num_free_blocks == total and engine.stats.num_running == 0:
                break
            await asyncio.sleep(0.05)
        assert engine.stats.num_free_blocks == total

    loop.run(scenario())


def test_abort_from_outside_ends_the_stream(shared):
    loop, engine = shared

    async def scenario():
        stream = engine.generate("The quick brown fox", LONG, "r1")
        await anext(stream)
        engine.abort("r1")
        with pytest.raises(RequestAbortedError):
            async for _ in stream:
                pass
        await wait_idle(engine)

    loop.run(scenario())


def test_invalid_prompt_raises_value_error(shared):
    loop, engine = shared

    async def scenario():
        with pytest.raises(ValueError, match="out of range"):
            async for _ in engine.generate([10**7], SamplingParams(max_tokens=2)):
                pass
        # The loop survives a bad request.
        outputs = [o async for o in engine.generate("hi", SamplingParams(max_tokens=2))]
        assert outputs[-1].finished

    loop.run(scenario())


def test_queue_limit_rejects_with_queue_full(shared):
    loop, engine = shared

    async def scenario():
        engine.max_queue_len = 2
        streams = [engine.generate("hi", LONG, f"r{i}") for i in range(6)]
        tasks = [asyncio.ensure_future(anext(s)) for s in streams]
        for _ in range(400):
            if engine.stats.num_waiting >= 2:
                break
            await asyncio.sleep(0.05)
        with pytest.raises(QueueFullError):
            await anext(engine.generate("hi", LONG, "extra"))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
        engine.max_queue_len = None
        await wait_idle(engine)

    loop.run(scenario())


def test_not_ready_before_start_and_after_drain(tiny_model):
    async def scenario():
        engine = make(tiny_model)
        with pytest.raises(EngineNotReadyError):
            await anext(engine.generate("hi", SamplingParams()))
        engine.start()
        await engine.wait_ready()
        engine.begin_drain()
        assert not engine.ready
        with pytest.raises(EngineNotReadyError):
            await anext(engine.generate("hi", SamplingParams()))
        await engine.shutdown(0)

    run(scenario())


def test_load_failure_marks_engine_dead(tmp_path):
    async def scenario():
        engine = AsyncLLMEngine(EngineConfig(model=str(tmp_path / "missing"), device="cpu"))
        engine.start()
        with pytest.raises(EngineDeadError):
            await engine.wait_ready(timeout=60)
        assert engine.health_problem is not None and not engine.ready
        assert engine.failure is not None
        with pytest.raises(EngineDeadError):
            await anext(engine.generate("hi", SamplingParams()))
        await engine.shutdown(0)

    run(scenario())


def test_shutdown_aborts_what_outlives_the_grace_period(tiny_model):
    async def scenario():
        engine = make(tiny_model)
        engine.start()
        await engine.wait_ready()
        stream = engine.generate("hi", SamplingParams(max_tokens=500, ignore_eos=True), "r")
        await anext(stream)
        consumer = asyncio.ensure_future(_drain(stream))
        await engine.shutdown(0.2)
        with pytest.raises(RequestAbortedError):
            await consumer

    run(scenario())


async def _drain(stream) -> None:
    with contextlib.suppress(StopAsyncIteration):
        while True:
            await anext(stream)
