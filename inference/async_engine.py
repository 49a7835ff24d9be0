"""AsyncLLMEngine: the asyncio front of the engine, for the HTTP server.

The engine runs in a process of its own (``inference/engine_core.py``): in the server's
process its step loop would share the GIL with the event loop that writes every token of
every stream, and each would wait on the other. This side keeps the server's view:

- requests go to the engine process as commands (the messages both ways are those of
  ``inference/engine_messages.py``), through a sender thread (a full pipe must never block
  the event loop);
- a reader thread takes the engine's one message per step off the pipe (so the engine never
  waits on a busy event loop), unpickles it and hands it to the loop with one
  ``call_soon_threadsafe``; the loop turns the step's token rows into each request's delta
  (text, stop strings, decoded logprobs: ``TextOutputs``, ``inference/text_output.py``),
  appends it to that request's queue, and tells the engine which completions a stop
  string ended;
- ``generate`` yields one output per engine step per request: deltas for the server's
  handlers (``delta=True``), or the cumulative view, assembled here, for everyone else;
- health: the engine process must be alive and heard from (a step message, or an idle
  heartbeat every second); if it dies or reports a failure, every in-flight request gets
  ``EngineDeadError`` at once and ``/health`` says why. A step watchdog covers the engine
  that neither dies nor answers (stopped, deadlocked, stuck in a kernel): once ready, if no
  message arrives for ``engine_step_timeout_s``, the reader thread declares it dead (same
  path: requests fail, ``/health`` 503) and kills it, since a late answer could no longer be
  delivered to anyone.

With ``pagoda serve --api-server-count N`` there are N API processes, each with one of
these: the first launches the engine process (``launch(num_fronts=N)``) and hands the other
processes their pipes; each of those ``attach``es to the running engine. A request's rows
come back to the process that added it; stats and timings reach every process, and each
sends the finish counts it saw (``FinishCounts``) to the engine, which passes them on to
all, so that any process's ``/metrics`` counts the whole engine's requests.

The tokenizer is loaded here as well (while the engine loads its weights), because the
server renders chat templates and checks prompt lengths before anything is queued.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

from inference.config import EngineConfig
from inference.engine_core import EngineFactory, default_engine_factory, run_engine_core
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
from inference.model_files import load_tokenizer
from inference.outputs import OutputAccumulator, RequestOutput
from inference.sampling_params import SamplingParams
from inference.text_output import TextOutputs

logger = logging.getLogger(__name__)

_PIPE_BYTES = 1 << 20  # room for many steps of output should the reader fall behind
_STOP_TIMEOUT_S = 30.0
# vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S: a chunked-prefill step is bounded by the token
# budget, so a minute without a single step means the engine is stuck.
DEFAULT_STEP_TIMEOUT_S = 60.0
# After the grace period, how long aborted requests get to send their error responses.
_ABORT_FLUSH_S = 5.0


class QueueFullError(Exception):
    """The waiting queue is at ``max_queue_len``; the client should retry later."""


class EngineNotReadyError(Exception):
    """The model is still loading or warming up, or the server is draining."""


class EngineDeadError(RuntimeError):
    """The engine process failed; nothing more will be served."""


class RequestAbortedError(Exception):
    """The request was aborted (client gone or server shutting down) before it finished."""


class EngineObserver(Protocol):
    """Hooks the event loop calls with what the engine process reports (metrics)."""

    def on_ready(self, info: EngineInfo, stats: EngineStats) -> None: ...
    def on_stats(self, stats: EngineStats, timings: StepTimings | None) -> None: ...


class _Stream:
    __slots__ = ("items", "waiter", "error", "aborted", "abort_sent", "abort_reason")

    def __init__(self) -> None:
        # the request's delta output per step that produced something
        self.items: deque[RequestOutput] = deque()
        self.waiter: asyncio.Future | None = None
        self.error: BaseException | None = None
        self.aborted = False
        self.abort_sent = False
        self.abort_reason: str | None = None

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _merge_deltas(output: RequestOutput, later: RequestOutput) -> RequestOutput:
    """``later``'s delta appended to ``output``'s (both the request's, not yet handed out):
    when the consumer lags behind the engine, the steps queued for it go out as one output
    (one SSE event, one write), as vLLM V1's output collector merges them."""
    completions = {c.index: c for c in output.outputs}
    for c in later.outputs:
        merged = completions.get(c.index)
        if merged is None:
            output.outputs.append(c)
            completions[c.index] = c
            continue
        merged.text += c.text
        merged.token_ids = merged.token_ids + c.token_ids
        if c.logprobs is not None:
            merged.logprobs = (merged.logprobs or []) + c.logprobs
        merged.cumulative_logprob = c.cumulative_logprob
        merged.finish_reason, merged.stop_reason = c.finish_reason, c.stop_reason
    output.finished = later.finished
    if later.prompt_logprobs is not None:
        output.prompt_logprobs = later.prompt_logprobs
    return output


class AsyncLLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        max_queue_len: int | None = None,
        observer: EngineObserver | None = None,
        engine_factory: EngineFactory = default_engine_factory,
        engine_step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
    ) -> None:
        if max_queue_len is not None and max_queue_len < 1:
            raise ValueError(f"max_queue_len must be >= 1, got {max_queue_len}")
        if not engine_step_timeout_s > 0:
            raise ValueError(f"engine_step_timeout_s must be > 0, got {engine_step_timeout_s}")
        self._config = config
        self.max_queue_len = max_queue_len
        self.observer = observer
        self._engine_factory = engine_factory  # runs in the engine process: must pickle
        self._step_timeout_s = engine_step_timeout_s

        self._loop: asyncio.AbstractEventLoop | None = None
        self._process: BaseProcess | _EnginePeer | None = None
        self._attached = False  # another API process launched the engine (``attach``)
        self._shared = False  # other API processes share the engine
        self._commands: Connection | None = None  # to the engine process
        self._outputs: Connection | None = None  # from the engine process
        # Commands for the sender thread; None is its stop sign.
        self._outbox: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._process_lock = threading.Lock()
        self._info: EngineInfo | None = None
        self._tokenizer: Any = None
        self._ready = False
        self._stopping = False
        self._accepting = True
        self._dead: EngineDeadError | None = None
        self._last_message = time.monotonic()
        self._streams: dict[str, _Stream] = {}
        self._text = TextOutputs()  # token rows -> text: detokenizers, stop strings
        # Adds submitted here vs. adds the engine process has taken, paired with the stats
        # taken after them: their difference is the queue the stats cannot see yet.
        self._num_submitted_adds = 0
        self._snapshot: tuple[EngineStats, int] | None = None
        self._reconfigures: dict[str, asyncio.Future[Reconfigured]] = {}  # by token

    # ----- lifecycle -------------------------------------------------------------------

    def launch(self, num_fronts: int = 1) -> list[tuple[Connection, Connection]]:
        """Start the engine process, which begins loading the model at once; the server
        calls this before it imports and builds its app, so that both start together.
        ``start`` launches it too when this was not called. ``num_fronts`` > 1: other API
        processes will share the engine; returns the (commands, outputs) pipe ends each of
        them ``attach``es with (the caller closes its copies once it has handed them on)."""
        if self._process is not None:
            raise RuntimeError("AsyncLLMEngine already launched")
        context = multiprocessing.get_context("spawn")
        core_ends, front_ends = [], []
        for _ in range(num_fronts):
            commands_in, commands_out = context.Pipe(duplex=False)
            outputs_in, outputs_out = context.Pipe(duplex=False)
            for connection in (commands_out, outputs_in):
                _grow_pipe(connection)
            core_ends.append((commands_in, outputs_out))
            front_ends.append((commands_out, outputs_in))
        (commands_in, outputs_out), more_fronts = core_ends[0], core_ends[1:]
        self._commands, self._outputs = front_ends[0]
        self._shared = num_fronts > 1
        self._process = context.Process(
            target=run_engine_core,
            args=(
                self._config, commands_in, outputs_out, self._engine_factory,
                logging.getLogger().getEffectiveLevel(), more_fronts,
            ),
            name="pagoda-engine-core",
            daemon=False,  # the engine may spawn tensor-parallel workers of its own
        )  # fmt: skip
        self._process.start()
        # Only the child holds these ends now: its exit closes our pipe (EOF), and ours its.
        for ends in core_ends:
            for connection in ends:
                connection.close()
        atexit.register(self._stop_process)
        return front_ends[1:]

    def attach(self, commands: Connection, outputs: Connection, engine_pid: int) -> None:
        """Use an engine process another API process launched (``launch(num_fronts)``), over
        the pipes it handed on. Stopping leaves that process alone: only this one's
        requests end (the engine aborts those still running)."""
        if self._process is not None:
            raise RuntimeError("AsyncLLMEngine already launched")
        self._commands, self._outputs = commands, outputs
        self._process = _EnginePeer(engine_pid)
        self._attached = self._shared = True
        atexit.register(self._stop_process)

    def start(self) -> None:
        """Start taking the engine's messages (launching its process first unless
        ``launch`` did); it loads the model in the background. Call from the event loop
        that will consume the outputs."""
        if self._loop is not None:
            raise RuntimeError("AsyncLLMEngine already started")
        self._loop = asyncio.get_running_loop()
        if self._process is None:
            self.launch()
        self._last_message = time.monotonic()
        for target, name in (
            (self._read_loop, "engine-reader"),
            (self._send_loop, "engine-sender"),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    async def wait_ready(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready:
            if self._dead is not None:
                raise EngineDeadError(str(self._dead))
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("engine did not become ready in time")
            await asyncio.sleep(0.05)

    def begin_drain(self) -> None:
        """Stop accepting new requests (in-flight ones continue); /ready turns 503."""
        self._accepting = False

    async def drain(self, grace_s: float, *, now: bool = False) -> None:
        """Stop accepting, let in-flight requests finish for up to ``grace_s``, then abort
        the rest (their handlers answer with an error) and give them a moment to do so.
        ``now``: a second shutdown signal, which aborts at once."""
        self.begin_drain()
        deadline = time.monotonic() + (0.0 if now else grace_s)
        while self._streams and time.monotonic() < deadline and self._dead is None:
            await asyncio.sleep(0.05)
        if not self._streams:
            return
        if now:
            logger.warning("second signal: stopping now: aborting %d request(s) in flight",
                           len(self._streams))
            reason = "the server got a second shutdown signal and is stopping now"
        else:
            logger.warning(
                "grace period over: aborting %d request(s) still in flight", len(self._streams)
            )
            reason = (
                "the server is shutting down and the request did not finish within the grace "
                f"period ({grace_s:g} s, --shutdown-grace-seconds)"
            )
        for request_id in list(self._streams):
            self.abort(request_id, reason)
        deadline = time.monotonic() + _ABORT_FLUSH_S
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Drain (``drain``), then stop the engine process and wait for it to exit."""
        await self.drain(grace_s)
        await asyncio.to_thread(self._stop_process)

    def _stop_process(self) -> None:
        """Ask the engine process to stop; terminate it if it does not. Idempotent."""
        process = self._process
        if process is None or self._stopping:
            return
        self._stopping = True
        atexit.unregister(self._stop_process)
        self._outbox.put(Shutdown())
        self._outbox.put(None)  # the sender thread's stop sign
        # Attached: the engine serves on; it closes this process's pipes, the reader ends.
        if not self._attached and not self._wait_exit(_STOP_TIMEOUT_S):
            for kill in (process.terminate, process.kill):
                logger.warning("engine process %s did not stop; %s", process.pid, kill.__name__)
                with self._process_lock:
                    if process.is_alive():
                        kill()
                if self._wait_exit(5.0):
                    break
        for thread in self._threads:
            thread.join(5.0)
        self._commands.close()
        self._outputs.close()

    # ----- state -----------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready and self._accepting and self._dead is None

    @property
    def loaded(self) -> bool:
        return self._ready

    @property
    def health_problem(self) -> str | None:
        """Why the engine is unhealthy, or None if it is fine."""
        if self._dead is not None:
            return str(self._dead)
        if self._process is None:
            return "the engine has not been started"
        with self._process_lock:
            alive = self._process.is_alive()
        if not alive:
            return "the engine process is not running"
        silent_s = time.monotonic() - self._last_message
        if self._ready and silent_s > self._step_timeout_s:
            return self._hung_reason(silent_s)
        return None

    def _hung_reason(self, silent_s: float) -> str:
        return (
            f"the engine process has not answered for {silent_s:.0f} s (longer than "
            f"--engine-step-timeout {self._step_timeout_s:g} s): it is hung"
        )

    @property
    def failure(self) -> BaseException | None:
        """Why the engine stopped, if it failed."""
        return self._dead

    @property
    def engine(self) -> EngineInfo:
        """What the engine process reported about itself (config, model name, tokenizer)."""
        if self._info is None:
            raise EngineNotReadyError("the model is still loading")
        return self._info

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def engine_pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def config(self) -> EngineConfig:
        return self._info.config if self._info is not None else self._config

    @property
    def stats(self) -> EngineStats | None:
        """The engine stats taken after the latest step (None before warm-up ends)."""
        snapshot = self._snapshot
        return snapshot[0] if snapshot else None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def estimated_num_waiting(self) -> int:
        snapshot = self._snapshot
        if snapshot is None:
            return self._num_submitted_adds
        stats, drained = snapshot
        unseen = self._num_submitted_adds - drained
        # Requests the engine has not seen yet only wait if no running slot is free for them.
        free_slots = max(0, self.config.max_num_seqs - stats.num_running - stats.num_waiting)
        return stats.num_waiting + max(0, unseen - free_slots)

    # ----- requests (event loop side) --------------------------------------------------

    def _check_accepting(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if not self._ready:
            raise EngineNotReadyError("the model is still loading")
        if not self._accepting:
            raise EngineNotReadyError("the server is shutting down")
        if self.max_queue_len is not None and self.estimated_num_waiting() >= self.max_queue_len:
            raise QueueFullError(
                f"the waiting queue is full ({self.max_queue_len} requests); retry later"
            )

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
        *,
        delta: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield one output per engine step that produced something for the request; the
        last one has ``finished`` set. With ``delta`` each output holds only the new token
        ids, text and logprobs (and only the completions that changed); otherwise the
        cumulative output so far. Closing the iterator early (client gone, task cancelled)
        aborts the request and frees its KV blocks."""
        self._check_accepting()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        stream = _Stream()
        self._streams[request_id] = stream
        self._num_submitted_adds += 1
        arrival = arrival_time if arrival_time is not None else time.time()
        self._text.add(request_id, params)
        self._submit(AddRequest(request_id, prompt, params, arrival, lora_request))
        accumulator = None
        if not delta:
            prompt_ids = list(prompt) if not isinstance(prompt, str) else []
            text = prompt if isinstance(prompt, str) else None
            accumulator = OutputAccumulator(request_id, text, prompt_ids)
        loop = self._loop
        assert loop is not None
        finished = False
        try:
            items = stream.items
            while True:
                while not items:
                    if stream.error is not None:
                        raise stream.error
                    if stream.aborted:
                        raise RequestAbortedError(
                            stream.abort_reason or f"request {request_id} was aborted"
                        )
                    stream.waiter = loop.create_future()
                    try:
                        await stream.waiter
                    finally:
                        stream.waiter = None
                output = items.popleft()
                if accumulator is not None:
                    accumulator.add(output)
                    while items:  # steps that queued up meanwhile: one output for all
                        accumulator.add(items.popleft())
                    finished = accumulator.finished
                    output = accumulator.output()
                else:
                    while items:
                        output = _merge_deltas(output, items.popleft())
                    finished = output.finished
                yield output
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            gone = not finished and stream.error is None
            self._text.remove(request_id, aborted=gone)
            if gone and not stream.abort_sent:
                stream.abort_sent = True
                self._submit(AbortRequests([request_id]))

    def remove_lora(self, lora_int_id: int) -> None:
        """An adapter was unloaded: the engine frees its slot (requests running with it
        finish with it)."""
        self._submit(RemoveLoRA(lora_int_id))

    def abort(self, request_id: str, reason: str | None = None) -> None:
        """Abort a request from the event loop; its generator raises RequestAbortedError
        (with ``reason`` as its message)."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.aborted = True
            stream.abort_reason = reason
            stream.wake()
            if stream.abort_sent:
                return
            stream.abort_sent = True
        self._submit(AbortRequests([request_id]))

    async def reconfigure(
        self, changes: dict[str, Any], *, dry_run: bool = False, timeout_s: float = 600.0
    ) -> Reconfigured:
        """Change live settings in the engine between two steps (``inference.reconfigure``)
        and return once the change is in effect, or was refused (``status`` 409/422); with
        ``dry_run`` only what it would cost. The server's view of the config follows."""
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if not self._ready:
            raise EngineNotReadyError("the model is still loading")
        token = uuid.uuid4().hex
        future = self._reconfigures[token] = self._loop.create_future()
        self._submit(Reconfigure(token, dict(changes), dry_run))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._reconfigures.pop(token, None)

    def _on_reconfigured(self, message: Reconfigured) -> None:
        if message.config is not None and self._info is not None:
            self._info.config = message.config
            self._info.num_total_blocks = message.num_total_blocks
            on_config = getattr(self.observer, "on_config", None)
            if on_config is not None:
                on_config(self._info)
        future = self._reconfigures.get(message.token)
        if future is not None and not future.done():
            future.set_result(message)

    def _submit(self, command: Command) -> None:
        if not self._stopping:
            self._outbox.put(command)

    # ----- messages from the engine process (event loop side) --------------------------

    def _on_messages(self, messages: list[Message]) -> None:
        self._last_message = time.monotonic()
        for message in messages:
            if isinstance(message, StepOutputs):
                self._on_step(message)
            elif isinstance(message, Heartbeat):
                self._on_stats(message.stats, message.num_adds, message.timings)
            elif isinstance(message, AddRejected):
                text = message.message
                error = (
                    ValueError(text) if message.type_name == "ValueError" else RuntimeError(text)
                )
                self._fail(message.request_id, error)
            elif isinstance(message, Reconfigured):
                self._on_reconfigured(message)
            elif isinstance(message, Ready):
                self._on_ready(message)
            elif isinstance(message, Dead):
                self._die(message.reason)

    def _on_stats(self, stats: EngineStats, num_adds: int, timings: StepTimings | None) -> None:
        self._snapshot = (stats, num_adds)
        finished = self._text.take_finished()
        if finished and self._shared:  # the engine passes them on to every API process
            self._submit(FinishCounts(finished))
        elif finished:  # counted here, where the final finish reason is known
            timings = timings or StepTimings()
            for reason, count in finished.items():
                timings.finished[reason] = timings.finished.get(reason, 0) + count
        if self.observer is not None:
            self.observer.on_stats(stats, timings)

    def _on_step(self, message: StepOutputs) -> None:
        outputs, stops = self._text.process(message.rows)
        if stops:
            self._submit(StopSequences(stops))
        self._on_stats(message.stats, message.num_adds, message.timings)
        streams = self._streams
        for request_id, output in outputs.items():
            stream = streams.get(request_id)
            if stream is not None and not stream.aborted:
                stream.items.append(output)
                stream.wake()

    def _on_ready(self, message: Ready) -> None:
        info = message.info
        info.tokenizer = self._tokenizer
        self._text.set_tokenizer(self._tokenizer, info.eos_token_ids)
        self._info = info
        self._snapshot = (message.stats, message.num_adds)
        if self.observer is not None:
            self.observer.on_ready(info, message.stats)
        gc.collect()  # the app, tokenizer and engine front live as long as the server:
        gc.freeze()  # keep them out of the full collections that would stall streaming
        self._ready = True
        logger.info("engine ready: %s (engine process %d)", info.model_name, info.pid)

    def _on_exit(self, exit_code: int | None) -> None:
        if self._dead is None and not self._stopping:
            self._die(f"the engine process exited unexpectedly (exit code {exit_code})")
        else:
            self._fail_all(str(self._dead or "the engine process stopped"))

    def _die(self, reason: str) -> None:
        if self._dead is None:
            logger.error("engine failed: %s", reason)
            self._dead = EngineDeadError(reason)
        self._fail_all(str(self._dead))

    def _fail(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and not stream.aborted:
            stream.error = error
            stream.wake()

    def _fail_all(self, reason: str) -> None:
        for request_id in list(self._streams):
            self._fail(request_id, EngineDeadError(reason))
        for future in self._reconfigures.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))

    # ----- threads ---------------------------------------------------------------------

    def _post(self, callback: Callable[..., None], *args: Any) -> bool:
        loop = self._loop
        try:
            loop.call_soon_threadsafe(callback, *args)  # type: ignore[union-attr]
        except RuntimeError:  # the loop is closed: nobody is listening any more
            return False
        return True

    def _read_loop(self) -> None:
        """Reader thread: messages off the pipe as soon as they arrive, to the loop in one
        callback per batch; the tokenizer loads here while the engine loads weights."""
        connection = self._outputs
        closed = False
        while not closed:
            messages: list[Message] = []
            if self._ready and not self._stopping and not self._watchdog(connection):
                continue  # the engine was killed: the next recv sees the pipe close
            try:
                messages.extend(connection.recv())
                while len(messages) < 256 and connection.poll():
                    messages.extend(connection.recv())
            except (EOFError, OSError):
                closed = True  # the engine process exited: deliver what it said last
            for message in messages:
                if isinstance(message, Resolved):
                    messages = self._load_tokenizer(message.tokenizer_path, messages)
            if messages and not self._post(self._on_messages, messages):
                return
        if self._attached and self._stopping:  # the engine let go of this process
            self._post(self._on_exit, None)
            return
        self._wait_exit(1.0)
        with self._process_lock:
            exit_code = self._process.exitcode
        self._post(self._on_exit, exit_code)

    def _watchdog(self, connection: Connection) -> bool:
        """Wait for the engine's next message for up to the step timeout; True if one came.
        If none did, the engine is hung: fail everything and kill it."""
        if connection.poll(self._step_timeout_s):
            return True
        reason = self._hung_reason(time.monotonic() - self._last_message)
        logger.error("%s; killing engine process %s", reason, self._process.pid)
        self._post(self._die, reason)
        with self._process_lock:
            if self._process.is_alive():
                self._process.kill()  # SIGKILL also ends a stopped process
        return False

    def _wait_exit(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the engine process to exit; True if it has. Reaping
        happens under a lock: two threads reaping one child race (one sees ECHILD)."""
        process = self._process
        if not multiprocessing.connection.wait([process.sentinel], timeout):
            return False
        with self._process_lock:
            # The sentinel closes a moment before the child can be reaped; join's blocking
            # wait reaps it (is_alive alone can still say True then).
            process.join(5.0)
            return not process.is_alive()

    def _load_tokenizer(self, path: str, messages: list[Message]) -> list[Message]:
        try:
            self._tokenizer = load_tokenizer(path)
        except Exception as exc:  # noqa: BLE001 - reported as the engine's death
            logger.exception("cannot load the tokenizer from %s", path)
            self._outbox.put(Shutdown())
            return [*messages, Dead(f"cannot load the tokenizer from {path}: {exc}")]
        return messages

    def _send_loop(self) -> None:
        """Sender thread: commands to the engine process, batched, off the event loop."""
        outbox = self._outbox
        connection = self._commands
        while True:
            batch = [outbox.get()]
            while True:
                try:
                    batch.append(outbox.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch
            commands = [command for command in batch if command is not None]
            if commands:
                try:
                    connection.send(commands)
                except (OSError, EOFError, ValueError):
                    return  # the engine process is gone; the reader reports it
            if stop:
                return


class _EnginePeer:
    """The engine process as an API process that did not start it sees it (``attach``):
    what ``multiprocessing.Process`` offers that process's health checks, through a pidfd
    (it cannot be joined or reaped from here, and its exit code is not known here)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.exitcode: int | None = None
        try:
            self.sentinel = os.pidfd_open(pid)
        except ProcessLookupError:  # already gone: a descriptor that reads as closed
            read, write = os.pipe()
            os.close(write)
            self.sentinel = read

    def is_alive(self) -> bool:
        return not multiprocessing.connection.wait([self.sentinel], 0)

    def join(self, timeout: float | None = None) -> None:
        multiprocessing.connection.wait([self.sentinel], timeout)

    def _signal(self, sig: int) -> None:
        if self.is_alive():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)


def _grow_pipe(connection: Connection) -> None:
    try:
        import fcntl

        fcntl.fcntl(connection.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), _PIPE_BYTES)
    except (ImportError, OSError):
        pass  # not Linux, or above the system's pipe-max-size: the default still works
