"""AsyncLLMEngine without HTTP: streaming, abort on close, errors, readiness, shutdown."""

from __future__ import annotations

import asyncio
import contextlib

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


def test_streams_cumulative_outputs_then_finishes(tiny_model):
    async def scenario():
        engine = make(tiny_model)
        assert not engine.ready
        engine.start()
        assert engine.healthy
        await engine.wait_ready()
        assert engine.ready and engine.healthy
        params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
        lengths = []
        async for output in engine.generate("The quick brown fox", params, "r1"):
            lengths.append(len(output.outputs[0].token_ids))
        assert output.finished and output.outputs[0].finish_reason == "length"
        assert lengths == sorted(lengths) and lengths[-1] == 8
        await engine.shutdown(1)
        assert not engine.ready

    run(scenario())


def test_closing_the_stream_aborts_and_frees_blocks(tiny_model):
    async def scenario():
        engine = make(tiny_model)
        engine.start()
        await engine.wait_ready()
        total = engine.stats.num_total_blocks
        stream = engine.generate("The quick brown fox", LONG, "r1")
        await anext(stream)
        await stream.aclose()
        for _ in range(400):
            if engine.stats.num_free_blocks == total and engine.stats.num_running == 0:
                break
            await asyncio.sleep(0.05)
        assert engine.stats.num_free_blocks == total
        await engine.shutdown(1)

    run(scenario())


def test_abort_from_outside_ends_the_stream(tiny_model):
    async def scenario():
        engine = make(tiny_model)
        engine.start()
        await engine.wait_ready()
        stream = engine.generate("The quick brown fox", LONG, "r1")
        await anext(stream)
        engine.abort("r1")
        with pytest.raises(RequestAbortedError):
            async for _ in stream:
                pass
        await engine.shutdown(1)

    run(scenario())


def test_invalid_prompt_raises_value_error(tiny_model):
    async def scenario():
        engine = make(tiny_model)
        engine.start()
        await engine.wait_ready()
        with pytest.raises(ValueError, match="out of range"):
            async for _ in engine.generate([10**7], SamplingParams(max_tokens=2)):
                pass
        # The loop survives a bad request.
        outputs = [o async for o in engine.generate("hi", SamplingParams(max_tokens=2))]
        assert outputs[-1].finished
        await engine.shutdown(1)

    run(scenario())


def test_queue_limit_rejects_with_queue_full(tiny_model):
    async def scenario():
        engine = make(tiny_model, max_queue_len=2)
        engine.start()
        await engine.wait_ready()
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
        await engine.shutdown(1)

    run(scenario())


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
        assert not engine.healthy and not engine.ready
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
