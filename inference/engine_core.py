"""The engine core: ``LLMEngine`` in a process of its own, as in vLLM V1.

The HTTP server's event loop builds and writes one SSE chunk per token per request; the
engine's step loop is Python too. In one process they share the GIL and each waits on the
other, so the engine runs here, in a "spawn" child, and the server only talks to it through
two pipes. The child is not daemonic (with tensor parallelism the engine spawns worker
processes itself, which daemonic processes may not), so it watches its parent instead: it
exits when its command pipe closes, and a watchdog thread ends it if the parent dies while
a step is stuck.

The loop: take every pending command without blocking while there is work (block, with a
heartbeat timeout, when idle), ``step()``, and send ONE message per step carrying every
request's *new* output (token ids, logprobs, finish reason: deltas, so pickling stays
proportional to what changed) as ``OutputRows``, the engine stats and the per-request
timings the metrics need. Every request is added with ``RequestOutputKind.DELTA``; the
engine makes no text here (``leave_text_to_server``): the server detokenizes, finds stop
strings and tells the engine which completions they ended (``StopSequences``), as vLLM
V1's API process does (``inference/text_output.py``).

The messages both ways are the dataclasses of ``inference/engine_messages.py``; what the
loop needs of the engine is ``CoreEngine`` (``LLMEngine`` is the one in production).

Several API processes (``pagoda serve --api-server-count N``) share one core, each through
two pipes of its own (a ``_Front``): the loop waits on every front's command pipe, a
request's rows go back to the front that added it, and what describes the whole engine
(stats, timings, readiness, live changes, death) goes to every front. The first front owns
the core: its ``Shutdown`` or closed pipe stops it. Another front's leaves alone: its
requests still running are aborted and the core serves on.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import multiprocessing.connection
import os
import resource
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Protocol

from inference.config import EngineConfig, ResolvedEngineConfig
from inference.detokenizer import CONTEXT_TOKENS
from inference.engine_messages import (
    AbortRequests,
    AddRejected,
    AddRequest,
    Command,
    Dead,
    EngineInfo,
    EngineStats,
    FinishCounts,
    Heartbeat,
    Message,
    OutputRows,
    Ready,
    Reconfigure,
    Reconfigured,
    RemoveLoRA,
    Resolved,
    Shutdown,
    StepOutputs,
    StepTimings,
    StopSequences,
)
from inference.lora.request import LoRARequest
from inference.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    import torch

    from inference.models.config import ModelConfig
    from inference.outputs import RequestOutput
    from inference.reconfigure import LiveChange
    from inference.structured_output import GrammarCompiler

logger = logging.getLogger(__name__)

STEP_TRACE_ENV = "PAGODA_STEP_TRACE"  # a CSV path: one row per engine step, written at exit
HEARTBEAT_S = 1.0  # an idle core sends its stats this often: the server's liveness signal
HEALTH_CHECK_S = 1.0  # how often a busy core asks the engine whether its workers live
# How often an idle core looks whether a live change's CUDA graphs are ready.
LIVE_CHANGE_POLL_S = 0.02
PARENT_GRACE_S = 5.0  # after the parent died, how long the loop may take to notice by itself
_WARMUP_MAX_STEPS = 10_000
_WARMUP_PROMPT_TOKENS = 8
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class CoreEngine(Protocol):
    """What the engine-core loop drives: ``LLMEngine``, or a test's wrapper around one."""

    config: ResolvedEngineConfig
    model_name: str
    model_config: ModelConfig
    num_total_blocks: int
    dtype: torch.dtype
    device: torch.device
    startup_phases: dict[str, float]
    grammars: GrammarCompiler
    computed_tokens_total: int  # tokens run through the model so far
    eos_token_ids: set[int]

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None: ...
    def abort_request(self, request_id: str | list[str]) -> None: ...
    def stop_sequences(self, stops: list[tuple[str, int, str]]) -> None: ...
    def leave_text_to_server(self) -> None: ...
    def has_unfinished_requests(self) -> bool: ...
    def step(self) -> list[RequestOutput]: ...
    def stats(self) -> EngineStats: ...
    def check_health(self) -> None: ...
    def shutdown(self) -> None: ...


EngineFactory = Callable[[EngineConfig], CoreEngine]


def _engine_info(engine: CoreEngine, tokenizer_path: str | None) -> EngineInfo:
    return EngineInfo(
        config=engine.config,
        model_name=engine.model_name,
        tokenizer_path=tokenizer_path,
        vocab_size=engine.model_config.vocab_size,
        num_total_blocks=engine.num_total_blocks,
        dtype=str(engine.dtype).removeprefix("torch."),
        kv_cache_dtype=str(engine.kv_cache_dtype).removeprefix("torch."),
        device=str(engine.device),
        startup_phases=dict(engine.startup_phases),
        pid=os.getpid(),
        generation_defaults=dict(getattr(engine, "generation_defaults", {})),
        eos_token_ids=tuple(sorted(engine.eos_token_ids)),
    )


def _add_finished(
    timings: StepTimings, request: _CoreRequest, output: RequestOutput, now: float
) -> None:
    """A finished request's latencies and sizes, into ``timings`` (its finish reason is
    counted by the server, which knows the final one)."""
    metrics = output.metrics
    scheduled = metrics.first_scheduled_time if metrics is not None else None
    first_token = metrics.first_token_time if metrics is not None else None
    last_token = metrics.last_token_time if metrics is not None else None
    arrival = request.arrival
    timings.e2e.append(max(0.0, now - arrival))
    # Never scheduled (aborted while waiting): all of its life was queueing.
    timings.queue.append(max(0.0, (scheduled or now) - arrival))
    if scheduled is not None:
        timings.prefill.append(max(0.0, (first_token or now) - scheduled))
        timings.decode.append(max(0.0, (last_token or now) - first_token) if first_token else 0.0)
        timings.inference.append(max(0.0, (last_token or now) - scheduled))
    timings.prompt_tokens.append(len(output.prompt_token_ids))
    timings.generation_tokens.append(request.num_generated)


def _thread_usage() -> tuple[float, int]:
    """This thread's CPU seconds and involuntary context switches so far."""
    usage = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF))
    return usage.ru_utime + usage.ru_stime, usage.ru_nivcsw


def _device_wait(engine: CoreEngine | None) -> float:
    return getattr(engine, "device_wait_s_total", 0.0)


def default_engine_factory(config: EngineConfig) -> CoreEngine:
    from inference.llm_engine import LLMEngine

    logger.info("building the engine")
    return LLMEngine(config)


class _Shutdown(Exception):
    """The server asked the core to stop, or its pipe closed."""


class _FrontGone(Exception):
    """An API process other than the first left (``Shutdown``, or its pipe closed)."""


class _StartError(Exception):
    """Loading or warming up the engine failed."""


class _Front:
    """One API process's two pipes, and how many of its ``AddRequest``s the core took."""

    __slots__ = ("index", "commands", "outputs", "num_adds")

    def __init__(self, index: int, commands: Connection | None, outputs: Connection | None):
        self.index = index  # 0: the API process that owns the core
        self.commands = commands
        self.outputs = outputs
        self.num_adds = 0


class _CoreRequest:
    """One request's latency bookkeeping, and the front it came from."""

    __slots__ = ("arrival", "front", "last_token_time", "num_generated", "tail_sent")

    def __init__(self, arrival: float, front: int = 0) -> None:
        self.arrival = arrival
        self.front = front
        self.last_token_time: float | None = None
        self.num_generated = 0  # tokens of all n completions
        self.tail_sent = False  # the prompt's last tokens went out with its first row


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        commands: Connection | None,
        outputs: Connection | None,
        engine_factory: EngineFactory = default_engine_factory,
        more_fronts: Sequence[tuple[Connection, Connection]] = (),
    ) -> None:
        """``commands``/``outputs``: the first API process's pipes; ``more_fronts``: the
        (commands, outputs) pipes of the others (``--api-server-count``)."""
        self.config = config
        self.fronts = [_Front(0, commands, outputs)] + [
            _Front(i, c, o) for i, (c, o) in enumerate(more_fronts, start=1)
        ]
        self.open_fronts = list(self.fronts)  # the fronts still attached
        self.engine_factory = engine_factory
        self.engine: CoreEngine | None = None
        self.requests: dict[str, _CoreRequest] = {}
        self.timings = StepTimings()
        self.next_health_check = 0.0
        # (start wall time, step s, send s, running, waiting, new prompt tokens, new
        # output tokens) per step, when PAGODA_STEP_TRACE names a file: where a latency
        # tail comes from (a long step, a long send, a queue) without a profiler.
        self.trace_path = os.environ.get(STEP_TRACE_ENV) or None
        # and, to tell a slow CPU from waiting: the loop thread's CPU time over step and send,
        # and how often the kernel took the CPU from it meanwhile (involuntary switches).
        self.trace: list[tuple] = []
        # and how long the step waited for the device (the rest of it is host work).
        self.trace_usage = (0.0, 0, 0.0)
        self.trace_totals: tuple[int, int] | None = None  # token counters before the step
        self.computed_tokens = 0  # the engine's computed_tokens_total after the last step
        # A live change waiting for its CUDA graphs, and the token its answer goes with: it
        # is answered once in effect (or refused), while steps go on.
        self.live_change: tuple[str, LiveChange] | None = None
        self.next_heartbeat = 0.0

    # ----- lifecycle ---------------------------------------------------------------------

    def run(self) -> int:
        """Load, warm up, serve until told to stop. Returns the process exit code."""
        try:
            self._loop(self._start())
        except _Shutdown:
            return 0
        except BaseException as exc:  # noqa: BLE001 - report, then exit non-zero
            logger.exception("engine core failed")
            if isinstance(exc, _StartError):
                self._send_dead(str(exc))
            else:
                self._send_dead(f"engine failed: {type(exc).__name__}: {exc}")
            return 1
        finally:
            self._shutdown_engine()
            self._write_trace()
        return 0

    def _shutdown_engine(self) -> None:
        """Stop what the engine started (tensor-parallel workers), failed or not."""
        if self.engine is None:
            return
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001 - exiting anyway
            logger.exception("engine shutdown failed")

    def _start(self) -> CoreEngine:
        from inference.model_files import resolve_model

        try:
            path = resolve_model(self.config.model)
        except Exception as exc:
            raise _StartError(f"engine failed to start: {exc}") from exc
        tokenizer_path = str(self.config.tokenizer or path)
        self._send([Resolved(tokenizer_path)])
        try:
            engine = self.engine = self.engine_factory(self.config)
            _warm_up(engine)
            engine.leave_text_to_server()
            engine.grammars.prepare()  # structured outputs' tokenizer view, in the background
            # What exists now (model, tokenizer, caches) lives for the whole process: keep it
            # out of the cyclic collector, whose full passes would otherwise stall steps.
            gc.collect()
            gc.freeze()
        except _Shutdown:
            raise
        except Exception as exc:
            raise _StartError(f"engine failed to start: {type(exc).__name__}: {exc}") from exc
        info = _engine_info(engine, tokenizer_path)
        stats = engine.stats()
        self.trace_totals = (stats.prompt_tokens_total, stats.generation_tokens_total)
        self.computed_tokens = engine.computed_tokens_total
        for front in self.open_fronts:
            self._send_to(front, [Ready(info, stats, front.num_adds)])
        logger.info("engine core ready: %s (pid %d)", info.model_name, info.pid)
        return engine

    def _loop(self, engine: CoreEngine) -> None:
        while True:
            busy = engine.has_unfinished_requests()
            idle_wait = LIVE_CHANGE_POLL_S if self.live_change is not None else HEARTBEAT_S
            ready = self._wait_commands(0 if busy else idle_wait)
            if ready:
                self._take_commands(engine, ready)
                if not engine.has_unfinished_requests():
                    self._answer_live_change(engine)
                    self._send_stats(engine)
                    continue
            elif not busy:
                self._answer_live_change(engine)
                # Polled often while a change waits for its graphs: the heartbeat stays 1 s.
                if self.live_change is None or time.monotonic() >= self.next_heartbeat:
                    self._check_health(engine)
                    self._send_stats(engine)  # the heartbeat
                continue
            start = time.time()
            if self.trace_path is not None:
                self.trace_usage = (*_thread_usage(), _device_wait(engine))
            outputs = engine.step()
            now = time.time()
            self._count_iteration_tokens(engine)
            rows = self._rows(outputs, now)
            timings, self.timings = self.timings, StepTimings()
            stats = engine.stats()
            timings = timings or None
            for front in list(self.open_fronts):
                self._send_to(front, [StepOutputs(stats, front.num_adds, rows[front.index],
                                                  timings)])  # fmt: skip
            if self.trace_path is not None:
                self._trace_step(start, now, stats)
            if time.monotonic() >= self.next_health_check:
                self._check_health(engine)
            self._answer_live_change(engine)

    def _answer_live_change(self, engine: CoreEngine) -> None:
        """Between steps: the live change whose graphs are ready is made (or refused) and
        answered."""
        if self.live_change is None:
            return
        token, change = self.live_change
        engine.poll_reconfigure()  # type: ignore[attr-defined]
        if change.done:
            self.live_change = None
            self._send([_answer_change(engine, token, change)])

    def _count_iteration_tokens(self, engine: CoreEngine) -> None:
        computed = engine.computed_tokens_total
        if computed > self.computed_tokens:
            self.timings.iteration_tokens.append(computed - self.computed_tokens)
        self.computed_tokens = computed

    def _check_health(self, engine: CoreEngine) -> None:
        self.next_health_check = time.monotonic() + HEALTH_CHECK_S
        engine.check_health()  # raises with the reason

    def _trace_step(self, start: float, stepped: float, stats: EngineStats) -> None:
        totals = (stats.prompt_tokens_total, stats.generation_tokens_total)
        last = self.trace_totals or totals
        self.trace_totals = totals
        cpu, switches = _thread_usage()
        cpu0, switches0, wait0 = self.trace_usage
        self.trace.append((
            start, stepped - start, time.time() - stepped, stats.num_running, stats.num_waiting,
            totals[0] - last[0], totals[1] - last[1], cpu - cpu0, switches - switches0,
            _device_wait(self.engine) - wait0,
        ))  # fmt: skip

    def _write_trace(self) -> None:
        if not self.trace_path or not self.trace:
            return
        header = ("start_s,step_ms,send_ms,running,waiting,prompt_tokens,output_tokens,cpu_ms,"
                  "preempted,device_wait_ms\n")  # fmt: skip
        with open(self.trace_path, "w") as f:
            f.write(header)
            for (start, step, send, running, waiting, prompt, output, cpu, switches,
                 wait) in self.trace:  # fmt: skip
                f.write(f"{start:.6f},{step * 1e3:.3f},{send * 1e3:.3f},{running},{waiting},"
                        f"{prompt},{output},{cpu * 1e3:.3f},{switches},{wait * 1e3:.3f}\n")  # fmt: skip
        logger.info("step trace: %d steps written to %s", len(self.trace), self.trace_path)

    # ----- commands ----------------------------------------------------------------------

    def _wait_commands(self, timeout: float) -> list[_Front]:
        """The fronts with commands waiting (or a closed pipe), after up to ``timeout``."""
        fronts = self.open_fronts
        if len(fronts) == 1:  # one API process: a plain poll, the cheapest
            return fronts if fronts[0].commands.poll(timeout) else []
        ready = multiprocessing.connection.wait([f.commands for f in fronts], timeout)
        return [f for f in fronts if f.commands in ready]

    def _take_commands(self, engine: CoreEngine, fronts: list[_Front]) -> None:
        for front in fronts:
            try:
                while True:
                    try:
                        batch = front.commands.recv()
                    except (EOFError, OSError) as exc:
                        if front.index == 0:
                            raise _Shutdown() from exc
                        raise _FrontGone() from exc
                    for command in batch:
                        self._handle(engine, command, front)
                    if not front.commands.poll():
                        break
            except _FrontGone:
                self._drop_front(engine, front)

    def _drop_front(self, engine: CoreEngine, front: _Front) -> None:
        """An API process other than the first left: its requests are aborted (their last
        rows go nowhere) and its pipes closed; the core serves the others on."""
        if front not in self.open_fronts:
            return
        self.open_fronts.remove(front)
        for connection in (front.commands, front.outputs):
            connection.close()
        orphans = [rid for rid, request in self.requests.items() if request.front == front.index]
        if orphans:
            engine.abort_request(orphans)
        logger.info("API process %d left (%d request(s) aborted); %d still attached",
                    front.index, len(orphans), len(self.open_fronts))  # fmt: skip

    def _handle(self, engine: CoreEngine, command: Command, front: _Front | None = None) -> None:
        front = front or self.fronts[0]
        if isinstance(command, AddRequest):
            request_id = command.request_id
            front.num_adds += 1
            # Each step sends what is new (the server accumulates), whatever kind was asked;
            # the params are this process's own copy, unpickled from the command.
            params = command.params
            params.output_kind = RequestOutputKind.DELTA
            # Named only when given: engines (and tests' wrappers) without LoRA need not
            # take it.
            lora = {"lora_request": command.lora_request} if command.lora_request else {}
            try:
                engine.add_request(
                    request_id, command.prompt, params, arrival_time=command.arrival_time, **lora
                )
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the loop
                self._send_to(front, [AddRejected(request_id, type(exc).__name__, str(exc))])
                return
            self.requests[request_id] = _CoreRequest(command.arrival_time, front.index)
        elif isinstance(command, StopSequences):
            engine.stop_sequences(command.stops)
        elif isinstance(command, AbortRequests):
            # The engine hands each aborted request back as finished ("abort") with the
            # next step: its latencies are counted then, like every other request's.
            engine.abort_request(command.request_ids)
        elif isinstance(command, RemoveLoRA):
            remove = getattr(engine, "remove_lora", None)
            if remove is not None:
                remove(command.lora_int_id)
        elif isinstance(command, Reconfigure):
            answer = _reconfigure(engine, command)
            if isinstance(answer, Reconfigured):
                self._send([answer])
            else:  # waits for its graphs: answered once done (``_answer_live_change``)
                self.live_change = (command.token, answer)
        elif isinstance(command, FinishCounts):
            finished = self.timings.finished
            for reason, count in command.counts.items():
                finished[reason] = finished.get(reason, 0) + count
        elif isinstance(command, Shutdown):
            raise _Shutdown() if front.index == 0 else _FrontGone()
        else:
            logger.warning("unknown engine-core command %r", command)

    # ----- outputs -----------------------------------------------------------------------

    def _rows(self, outputs: list[RequestOutput], now: float) -> list[OutputRows]:
        """Each request's new output since the last step, for each front (by its index),
        and its latencies."""
        by_front = [OutputRows() for _ in self.fronts]
        requests = self.requests
        timings = self.timings
        for output in outputs:
            request_id = output.request_id
            request = requests.get(request_id)
            if request is None:
                continue  # aborted, or the warm-up request
            rows = by_front[request.front]
            request_ids, indexes, token_ids = rows.request_ids, rows.indexes, rows.token_ids
            logprobs, cumulative = rows.logprobs, rows.cumulative_logprobs
            finish_reasons, stop_reasons = rows.finish_reasons, rows.stop_reasons
            num_new = 0
            for c in output.outputs:
                request_ids.append(request_id)
                indexes.append(c.index)
                token_ids.append(c.token_ids)
                logprobs.append(c.logprobs)
                cumulative.append(c.cumulative_logprob)
                finish_reasons.append(c.finish_reason)
                stop_reasons.append(c.stop_reason)
                num_new += len(c.token_ids)
            if output.outputs and not request.tail_sent:
                request.tail_sent = True
                rows.prompt_tails[request_id] = output.prompt_token_ids[-CONTEXT_TOKENS:]
            if output.prompt_logprobs is not None:
                rows.prompt_logprobs[request_id] = output.prompt_logprobs
            if num_new:
                request.num_generated += num_new
                if request.last_token_time is None:
                    timings.ttft.append(max(0.0, now - request.arrival))
                else:
                    timings.itl.append(now - request.last_token_time)
                request.last_token_time = now
            if output.finished:
                del requests[request_id]
                _add_finished(timings, request, output, now)
        return by_front

    # ----- sending -----------------------------------------------------------------------

    def _send(self, messages: list[Message]) -> None:
        """To every front."""
        for front in list(self.open_fronts):
            self._send_to(front, messages)

    def _send_to(self, front: _Front, messages: list[Message]) -> None:
        try:
            front.outputs.send(messages)
        except (BrokenPipeError, EOFError, OSError) as exc:
            if front.index == 0:
                raise _Shutdown() from exc  # the server is gone
            if self.engine is not None:
                self._drop_front(self.engine, front)

    def _send_stats(self, engine: CoreEngine) -> None:
        self.next_heartbeat = time.monotonic() + HEARTBEAT_S
        timings, self.timings = self.timings, StepTimings()
        stats, timings = engine.stats(), timings or None
        for front in list(self.open_fronts):
            self._send_to(front, [Heartbeat(stats, front.num_adds, timings)])

    def _send_dead(self, reason: str) -> None:
        for front in self.open_fronts:
            try:
                front.outputs.send([Dead(reason)])
            except (OSError, EOFError):
                pass


def _reconfigure(engine: CoreEngine, command: Reconfigure) -> Reconfigured | LiveChange:
    """Plan a live change, or start it between steps: the answer now, or the change still
    waiting for its CUDA graphs (``_answer_change`` once it is done). A refusal changes
    nothing."""
    if getattr(engine, "begin_reconfigure", None) is None:
        return Reconfigured(command.token, 409, "this engine takes no live changes", {})
    from inference.reconfigure import ReconfigureError, change_costs, live_settings, plan_change

    try:
        if command.dry_run:
            plan = plan_change(engine, command.changes)
            return Reconfigured(command.token, 200, "planned", live_settings(engine),
                                plan.as_dict(), change_costs(engine))  # fmt: skip
        change = engine.begin_reconfigure(command.changes)  # type: ignore[attr-defined]
    except ReconfigureError as error:
        return Reconfigured(command.token, error.status, str(error), live_settings(engine),
                            costs=change_costs(engine))  # fmt: skip
    return _answer_change(engine, command.token, change) if change.done else change


def _answer_change(engine: CoreEngine, token: str, change: LiveChange) -> Reconfigured:
    """The answer to a change that is done: made, or refused (its capture failed)."""
    from inference.reconfigure import ReconfigureError, change_costs, live_settings

    try:
        plan, seconds = change.result()
    except ReconfigureError as error:
        return Reconfigured(token, error.status, str(error), live_settings(engine),
                            costs=change_costs(engine))  # fmt: skip
    return Reconfigured(
        token, 200, "applied", live_settings(engine), plan.as_dict(), change_costs(engine),
        seconds, engine.config, engine.num_total_blocks,
    )  # fmt: skip


def _warm_up(engine: CoreEngine) -> None:
    """One short request through the whole path, so the first client does not pay for
    lazy initialisation (kernel compilation, allocator growth, CUDA graph capture). Its
    prompt is token ids: some tokenizers (word-level ones) encode arbitrary text to nothing."""
    request_id = f"warmup-{uuid.uuid4().hex}"
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    vocab_size = engine.model_config.vocab_size
    engine.add_request(request_id, [i % vocab_size for i in range(_WARMUP_PROMPT_TOKENS)], params)
    for _ in range(_WARMUP_MAX_STEPS):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise RuntimeError("warm-up request did not finish")


def exit_with_parent() -> None:
    """Exit if the server process dies, even while a step is stuck (the loop notices a
    closed pipe by itself between steps)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        time.sleep(PARENT_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run_engine_core(
    config: EngineConfig,
    commands: Connection,
    outputs: Connection,
    engine_factory: EngineFactory = default_engine_factory,
    log_level: int = logging.INFO,
    more_fronts: Sequence[tuple[Connection, Connection]] = (),
) -> None:
    """The engine-core process's entry point."""
    # Ctrl-C reaches the whole process group: the server drains and then stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    logger.info("engine process %d started", os.getpid())
    exit_with_parent()
    core = EngineCore(config, commands, outputs, engine_factory, more_fronts)
    code = core.run()
    for front in core.open_fronts:
        front.commands.close()
        front.outputs.close()
    sys.exit(code)
