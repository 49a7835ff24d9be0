"""AsyncLLMEngine: the asyncio front of the engine, for the HTTP server.

The engine is synchronous and not thread-safe, so it lives on one dedicated thread that
owns it completely: that thread builds it (loading weights takes seconds to minutes and
must not block the event loop), warms it up, then loops ``drain inbox -> step -> publish``.
The event loop never calls the engine. It talks to the thread through an inbox of adds and
aborts (a list under a lock plus a wake-up event) and receives each step's outputs in one
``call_soon_threadsafe`` per step.

Outputs are cumulative, so a request's stream keeps only the latest one: a consumer that
falls behind (slow client, busy event loop) skips straight to the newest state instead of
working through a backlog, and per-token cost on the event loop stays bounded under load.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from inference.config import EngineConfig
from inference.outputs import RequestOutput
from inference.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_WARMUP_MAX_STEPS = 10_000


class QueueFullError(Exception):
    """The waiting queue is at ``max_queue_len``; the client should retry later."""


class EngineNotReadyError(Exception):
    """The model is still loading or warming up, or the server is draining."""


class EngineDeadError(RuntimeError):
    """The engine thread failed; nothing more will be served."""


class RequestAbortedError(Exception):
    """The request was aborted (client gone or server shutting down) before it finished."""


class StepObserver(Protocol):
    """Hooks the engine thread calls; the metrics layer implements them."""

    def on_ready(self, engine: Any) -> None: ...
    def on_add(self, request_id: str, arrival_time: float) -> None: ...
    def on_abort(self, request_id: str) -> None: ...
    def on_step(self, outputs: list[RequestOutput], stats: Any, now: float) -> None: ...
    def on_stats(self, stats: Any) -> None: ...


class _Stream:
    __slots__ = ("event", "latest", "error", "aborted", "abort_sent")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.latest: RequestOutput | None = None
        self.error: BaseException | None = None
        self.aborted = False
        self.abort_sent = False


def _default_engine_factory(config: EngineConfig) -> Any:
    from inference.llm_engine import LLMEngine

    return LLMEngine(config)


class AsyncLLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        max_queue_len: int | None = None,
        observer: StepObserver | None = None,
        engine_factory: Callable[[EngineConfig], Any] = _default_engine_factory,
        heartbeat_timeout_s: float = 120.0,
        idle_wait_s: float = 0.5,
    ) -> None:
        if max_queue_len is not None and max_queue_len < 1:
            raise ValueError(f"max_queue_len must be >= 1, got {max_queue_len}")
        self._config = config
        self.max_queue_len = max_queue_len
        self.observer = observer
        self._engine_factory = engine_factory
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._idle_wait_s = idle_wait_s

        self._engine: Any = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: list[tuple[str, str, Any]] = []
        self._inbox_lock = threading.Lock()
        self._wakeup = threading.Event()
        self._ready = threading.Event()
        self._stop_requested = False
        self._heartbeat = time.monotonic()
        self._dead: BaseException | None = None
        self._accepting = True
        self._streams: dict[str, _Stream] = {}
        # Adds submitted by the event loop vs. adds the engine thread has taken, paired with
        # the stats taken after them: their difference is the queue the stats cannot see yet.
        self._num_submitted_adds = 0
        self._num_drained_adds = 0
        self._snapshot: tuple[Any, int] | None = None

    # ----- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; it loads the model in the background. Call from the
        event loop that will consume the outputs."""
        if self._thread is not None:
            raise RuntimeError("AsyncLLMEngine already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._thread_main, name="engine-loop", daemon=True)
        self._thread.start()

    async def wait_ready(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready.is_set():
            if self._dead is not None:
                raise EngineDeadError(f"engine failed to start: {self._dead!r}") from self._dead
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("engine did not become ready in time")
            await asyncio.sleep(0.05)

    def begin_drain(self) -> None:
        """Stop accepting new requests (in-flight ones continue); /ready turns 503."""
        self._accepting = False

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Drain in-flight requests for up to ``grace_s``, abort the rest, stop the thread."""
        self.begin_drain()
        deadline = time.monotonic() + grace_s
        while self._streams and time.monotonic() < deadline and self._dead is None:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self.abort(request_id)
        self._stop_requested = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)

    # ----- state -----------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._accepting and self._dead is None

    @property
    def loaded(self) -> bool:
        return self._ready.is_set()

    @property
    def healthy(self) -> bool:
        if self._dead is not None or self._thread is None or not self._thread.is_alive():
            return False
        if not self._ready.is_set():
            return True  # loading: the thread is alive, which is all we can know
        return time.monotonic() - self._heartbeat < self._heartbeat_timeout_s

    @property
    def failure(self) -> BaseException | None:
        """Why the engine thread stopped, if it failed."""
        return self._dead

    @property
    def engine(self) -> Any:
        """The engine object, for read-only attributes (tokenizer, config). Never call its
        methods from outside the engine thread."""
        if self._engine is None:
            raise EngineNotReadyError("the model is still loading")
        return self._engine

    @property
    def config(self) -> EngineConfig:
        return self._engine.config if self._engine is not None else self._config

    @property
    def stats(self) -> Any:
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
            raise EngineDeadError(f"engine stopped: {self._dead!r}")
        if not self._ready.is_set():
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
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs as they are produced; the last one has
        ``finished`` set. Closing the iterator early (client gone, task cancelled) aborts
        the request and frees its KV blocks."""
        self._check_accepting()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        stream = _Stream()
        self._streams[request_id] = stream
        self._num_submitted_adds += 1
        arrival = arrival_time if arrival_time is not None else time.time()
        self._submit(("add", request_id, (prompt, params, arrival)))
        finished = False
        try:
            while True:
                await stream.event.wait()
                stream.event.clear()
                if stream.error is not None:
                    raise stream.error
                output, stream.latest = stream.latest, None
                if output is not None:
                    finished = output.finished
                    yield output
                    if finished:
                        return
                elif stream.aborted:
                    raise RequestAbortedError(request_id)
        finally:
            self._streams.pop(request_id, None)
            if not finished and stream.error is None and not stream.abort_sent:
                stream.abort_sent = True
                self._submit(("abort", request_id, None))

    def abort(self, request_id: str) -> None:
        """Abort a request from the event loop; its generator raises RequestAbortedError."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.aborted = True
            stream.event.set()
            if stream.abort_sent:
                return
            stream.abort_sent = True
        self._submit(("abort", request_id, None))

    def _submit(self, item: tuple[str, str, Any]) -> None:
        with self._inbox_lock:
            self._inbox.append(item)
        self._wakeup.set()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        streams = self._streams
        for output in outputs:
            stream = streams.get(output.request_id)
            if stream is not None:
                stream.latest = output
                stream.event.set()

    def _fail(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.error = error
            stream.event.set()

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._fail(request_id, error)

    # ----- engine thread ---------------------------------------------------------------

    def _thread_main(self) -> None:
        try:
            engine = self._engine_factory(self._config)
            self._engine = engine
            self._warm_up(engine)
            if self.observer is not None:
                self.observer.on_ready(engine)
            self._snapshot = (engine.stats(), self._num_drained_adds)
            self._heartbeat = time.monotonic()
            self._ready.set()
            logger.info("engine ready: %s", getattr(engine, "model_name", self._config.model))
            self._run_loop(engine)
        except BaseException as exc:  # noqa: BLE001 - the thread must report, not vanish
            logger.exception("engine loop failed")
            self._dead = exc
            if self._loop is not None and not self._loop.is_closed():
                dead = EngineDeadError(f"engine failed: {exc!r}")
                self._loop.call_soon_threadsafe(self._fail_all, dead)

    def _warm_up(self, engine: Any) -> None:
        """One short request through the whole path, so the first client does not pay for
        lazy initialisation (kernel compilation, allocator growth, CUDA graph capture)."""
        request_id = f"warmup-{uuid.uuid4().hex}"
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        engine.add_request(request_id, "Hello, warm-up.", params)
        for _ in range(_WARMUP_MAX_STEPS):
            if not engine.has_unfinished_requests():
                return
            engine.step()
        raise RuntimeError("warm-up request did not finish")

    def _run_loop(self, engine: Any) -> None:
        observer = self.observer
        loop = self._loop
        assert loop is not None
        while not self._stop_requested:
            self._heartbeat = time.monotonic()
            self._wakeup.clear()
            changed = self._drain_inbox(engine)
            if not engine.has_unfinished_requests():
                if changed:
                    stats = engine.stats()
                    self._snapshot = (stats, self._num_drained_adds)
                    if observer is not None:
                        observer.on_stats(stats)
                self._wakeup.wait(self._idle_wait_s)
                continue
            outputs = engine.step()
            stats = engine.stats()
            self._snapshot = (stats, self._num_drained_adds)
            if observer is not None:
                observer.on_step(outputs, stats, time.time())
            if outputs and not loop.is_closed():
                loop.call_soon_threadsafe(self._deliver, outputs)

    def _drain_inbox(self, engine: Any) -> bool:
        with self._inbox_lock:
            items, self._inbox = self._inbox, []
        observer = self.observer
        loop = self._loop
        assert loop is not None
        for kind, request_id, payload in items:
            if kind == "abort":
                engine.abort_request(request_id)
                if observer is not None:
                    observer.on_abort(request_id)
                continue
            self._num_drained_adds += 1
            prompt, params, arrival = payload
            try:
                engine.add_request(request_id, prompt, params, arrival_time=arrival)
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the loop
                loop.call_soon_threadsafe(self._fail, request_id, exc)
                continue
            if observer is not None:
                observer.on_add(request_id, arrival)
        return bool(items)
