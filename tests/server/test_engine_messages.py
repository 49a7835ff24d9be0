"""The engine-process messages: the server unpickles every one of them without importing
torch or the engine, and the core answers each command as the protocol says."""

from __future__ import annotations

import multiprocessing
import pickle
import subprocess
import sys

import pytest

from inference.config import EngineConfig
from inference.engine_core import EngineCore, _Shutdown
from inference.engine_messages import (
    AbortRequests,
    AddRejected,
    AddRequest,
    Dead,
    EngineInfo,
    EngineStats,
    Heartbeat,
    OutputRows,
    Ready,
    Resolved,
    Shutdown,
    StepOutputs,
    StepTimings,
    StopSequences,
)
from inference.outputs import CompletionOutput, RequestOutput
from inference.sampling_params import RequestOutputKind, SamplingParams

STATS = EngineStats(
    num_running=1, num_waiting=0, kv_cache_usage=0.5, num_total_blocks=8, num_free_blocks=4,
    num_preemptions_total=0, prefix_cache_queries_total=3, prefix_cache_hits_total=1,
    prompt_tokens_total=5, generation_tokens_total=2,
)  # fmt: skip


def test_messages_unpickle_without_torch():
    info = EngineInfo(
        config=None, model_name="m", tokenizer_path="/t", vocab_size=10, num_total_blocks=8,
        dtype="float32", device="cpu", tokenizer=object(),
    )  # fmt: skip
    rows = OutputRows(["r1"], [0], [[7, 8]], [None], [-0.5], ["stop"], [None], {"r1": [1, 2]})
    messages = [
        Resolved("/t"), Ready(info, STATS, 1), StepOutputs(STATS, 1, rows, StepTimings(ttft=[0.1])),
        Heartbeat(STATS, 1, None), AddRejected("r2", "ValueError", "bad"), Dead("gone"),
    ]  # fmt: skip
    data = pickle.dumps(messages)
    assert pickle.loads(data)[2] == messages[2]
    assert pickle.loads(data)[1].info.tokenizer is None  # the tokenizer never crosses
    code = (
        "import pickle, sys; messages = pickle.loads(sys.stdin.buffer.read()); "
        "assert messages[2].rows.token_ids == [[7, 8]]; "
        "assert 'torch' not in sys.modules, 'unpickling imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], input=data, check=True, timeout=120)


class _FakeEngine:
    def __init__(self) -> None:
        self.added: list[str] = []
        self.kinds: list[RequestOutputKind] = []
        self.aborted: list = []
        self.stopped: list = []

    def add_request(self, request_id, prompt, params, arrival_time=None) -> None:
        if not prompt:
            raise ValueError("the prompt is empty")
        self.added.append(request_id)
        self.kinds.append(params.output_kind)

    def abort_request(self, request_id) -> None:
        self.aborted.append(request_id)

    def stop_sequences(self, stops) -> None:
        self.stopped.append(stops)

    def stats(self) -> EngineStats:
        return STATS


def test_core_answers_each_command():
    received, sent = multiprocessing.Pipe(duplex=False)
    core = EngineCore(EngineConfig.from_kwargs("unused"), commands=None, outputs=sent)
    engine = _FakeEngine()
    params = SamplingParams(max_tokens=2, stop=["END"])
    core._handle(engine, AddRequest("ok", [1, 2], params, 1.0))
    core._handle(engine, AddRequest("bad", "", params, 2.0))
    core._handle(engine, AbortRequests(["ok", "gone"]))
    core._handle(engine, StopSequences([("ok", 0, "END")]))
    assert engine.added == ["ok"] and engine.aborted == [["ok", "gone"]]
    assert engine.stopped == [[("ok", 0, "END")]]
    assert engine.kinds == [RequestOutputKind.DELTA]  # the core streams what is new
    assert core.fronts[0].num_adds == 2 and list(core.requests) == ["ok"]
    assert core.requests["ok"].arrival == 1.0
    assert received.recv() == [AddRejected("bad", "ValueError", "the prompt is empty")]
    with pytest.raises(_Shutdown):
        core._handle(engine, Shutdown())


def test_core_rows_carry_each_completions_news_and_the_prompt_tail_once():
    """One row per completion with something new; the prompt's last tokens (the server's
    detokenizer context) with the request's first row only; a finished request leaves."""
    core = EngineCore(EngineConfig.from_kwargs("unused"), commands=None, outputs=None)
    core._handle(_FakeEngine(), AddRequest("r", list(range(10)), SamplingParams(n=2), 1.0))

    def output(finished: bool, *completions: CompletionOutput) -> RequestOutput:
        return RequestOutput("r", None, list(range(10)), list(completions), finished)

    first = core._rows([output(False, CompletionOutput(0, "", [7], None, None, "length"))], 2.0)[0]
    assert first.request_ids == ["r"] and first.token_ids == [[7]]
    assert first.finish_reasons == ["length"] and first.prompt_tails == {"r": [4, 5, 6, 7, 8, 9]}
    rows = core._rows([output(True, CompletionOutput(1, "", [8, 9], -1.5, [{8: None}, {9: None}],
                                                     "stop", 9))], 3.0)[0]  # fmt: skip
    assert (rows.request_ids, rows.indexes, rows.token_ids) == (["r"], [1], [[8, 9]])
    assert rows.cumulative_logprobs == [-1.5] and rows.stop_reasons == [9]
    assert rows.prompt_tails == {} and "r" not in core.requests
    assert core.timings.generation_tokens == [3] and core.timings.finished == {}


def test_rows_pickle_no_slower_than_the_tuples_they_replaced():
    """A 512-row step: the columns pickle and unpickle within the old per-row tuples'
    cost (the limit the issue set: 0.62 ms per step on the H200 host), measured here
    against those tuples on the same machine, with room for a loaded box."""
    import timeit

    n = 512
    rows = OutputRows(
        [f"req-{i:05d}" for i in range(n)], [0] * n, [[1000 + i] for i in range(n)], [None] * n,
        [None] * n, [None] * n, [None] * n,
    )  # fmt: skip
    tuples = [(f"req-{i:05d}", False, [(0, [1000 + i], " tok", None, None, None, None)], None)
              for i in range(n)]  # fmt: skip

    def cost(value) -> float:
        return min(timeit.repeat(lambda: pickle.loads(pickle.dumps(value)), number=20, repeat=5))

    assert cost(rows) <= 1.5 * cost(tuples)


def test_llm_engine_has_what_the_core_drives(tiny_model):
    """The core reads these without probing: ``LLMEngine`` must keep every one."""
    from inference.engine_core import CoreEngine
    from inference.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig.from_kwargs(tiny_model, device="cpu", num_kv_blocks=8, max_num_seqs=2, max_model_len=64)
    )
    try:
        members = set(CoreEngine.__annotations__) | {
            name for name in vars(CoreEngine) if not name.startswith("_")
        }
        assert {"add_request", "step", "num_total_blocks"} <= members
        assert [name for name in sorted(members) if not hasattr(engine, name)] == []
    finally:
        engine.shutdown()


def test_core_answers_a_change_once_its_graphs_are_ready_and_refuses_one_meanwhile(tiny_model):
    """A change that waits for CUDA graphs is answered by the core only once in effect,
    also while the engine is idle (no step runs); a second change meanwhile is answered at
    once, refused."""

    from server_harness import STEPS_DURING_CAPTURE, engine_capturing_in_background

    from inference.engine_messages import Reconfigure, Reconfigured

    received, sent = multiprocessing.Pipe(duplex=False)
    core = EngineCore(EngineConfig.from_kwargs("unused"), commands=None, outputs=sent)
    engine = engine_capturing_in_background(EngineConfig.from_kwargs(
        tiny_model, device="cpu", num_kv_blocks=16, max_num_seqs=2, max_num_batched_tokens=32,
        max_model_len=64))  # fmt: skip
    try:
        raised = {"max_num_seqs": 4, "max_num_batched_tokens": 64}
        core._handle(engine, Reconfigure("first", raised))
        assert core.live_change is not None and not received.poll()
        core._handle(engine, Reconfigure("second", {"max_num_seqs": 1}))
        [refused] = received.recv()
        assert isinstance(refused, Reconfigured) and refused.token == "second"
        assert refused.status == 409 and "under way" in refused.message
        core._answer_live_change(engine)
        assert not received.poll() and engine.scheduler.max_num_seqs == 2  # still capturing
        engine.runner.steps += STEPS_DURING_CAPTURE  # as if steps had run: the capture ends
        change = core.live_change[1]
        assert change.wait_captured(60)
        core._answer_live_change(engine)  # the idle core's poll
        [applied] = received.recv()
        assert applied.token == "first" and applied.status == 200 and applied.seconds > 0
        assert applied.settings["max_num_seqs"] == 4 and core.live_change is None
        assert engine.scheduler.max_num_seqs == 4
    finally:
        engine.shutdown()


def test_core_serves_two_api_processes_apart():
    """``--api-server-count 2``: rows and rejections go to the process that added the
    request, stats to both; the second leaving aborts its requests and the core serves on;
    finish counts one process reports reach both."""
    from inference.engine_core import _FrontGone
    from inference.engine_messages import FinishCounts

    fronts = []
    for _ in range(2):
        commands_in, commands_out = multiprocessing.Pipe(duplex=False)
        outputs_in, outputs_out = multiprocessing.Pipe(duplex=False)
        fronts.append(((commands_in, outputs_out), (commands_out, outputs_in)))
    (core0, (_, out0)), (core1, (cmd1, out1)) = fronts
    core = EngineCore(EngineConfig.from_kwargs("unused"), *core0, more_fronts=[core1])
    engine = core.engine = _FakeEngine()
    params = SamplingParams(max_tokens=2)
    core._handle(engine, AddRequest("a", [1, 2], params, 1.0), core.fronts[0])
    core._handle(engine, AddRequest("b", [1, 2], params, 1.0), core.fronts[1])
    core._handle(engine, AddRequest("bad", "", params, 2.0), core.fronts[1])
    assert out1.recv() == [AddRejected("bad", "ValueError", "the prompt is empty")]
    assert not out0.poll()
    assert (core.fronts[0].num_adds, core.fronts[1].num_adds) == (1, 2)

    def output(request_id: str) -> RequestOutput:
        return RequestOutput(request_id, None, [1, 2], [CompletionOutput(0, "", [7], None, None,
                                                                         None)], False)  # fmt: skip

    rows = core._rows([output("a"), output("b")], 2.0)
    assert rows[0].request_ids == ["a"] and rows[1].request_ids == ["b"]
    core._handle(engine, FinishCounts({"stop": 2}), core.fronts[1])
    core._send_stats(engine)
    for out, num_adds in ((out0, 1), (out1, 2)):
        (beat,) = out.recv()
        assert isinstance(beat, Heartbeat) and beat.num_adds == num_adds
        assert beat.timings.finished == {"stop": 2}
    # The second process says goodbye: its request is aborted, the first one's runs on.
    with pytest.raises(_FrontGone):
        core._handle(engine, Shutdown(), core.fronts[1])
    cmd1.send([AddRequest("c", [1], params, 3.0)])
    cmd1.close()  # closed after a last command: that command is taken, then the EOF
    ready = core._wait_commands(5.0)
    assert core.fronts[1] in ready
    core._take_commands(engine, ready)
    assert engine.added == ["a", "b", "c"] and engine.aborted == [["b", "c"]]
    assert core.open_fronts == [core.fronts[0]]
    assert core._wait_commands(0.0) == []
    core._send_stats(engine)  # only the first process hears from the core now
    assert isinstance(out0.recv()[0], Heartbeat)
