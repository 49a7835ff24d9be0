"""``MultiprocExecutor``: the engine's side of tensor parallelism.

The engine process holds no GPU and no model. It spawns one worker per rank and talks to
each over a ``multiprocessing`` pipe; the scheduler and block manager run once, here, and
each step's inputs (``StepInputs``: a few numpy arrays) are pickled once and written to
every pipe. Like the single-device ``ModelRunner`` it implements ``ModelExecutor``
(``interface``), so the engine does not care which one it holds.

Failure handling: while waiting for a reply the executor also watches every worker's
process sentinel, so a worker that dies (or raises) is noticed at once; the remaining
workers are killed (they may be stuck in a collective) and the executor stays failed:
every later call raises the same ``RuntimeError`` (see ``dead_reason``). Workers exit by
themselves when their pipe closes or their parent disappears, so no worker outlives the
engine, also when the engine is killed.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
import weakref
from dataclasses import replace
from multiprocessing.connection import wait

from inference.config import ResolvedEngineConfig
from inference.executor.messages import (
    AllocateKvCache,
    CaptureGraphs,
    DetermineNumBlocks,
    ExecuteStep,
    Flush,
    NewSequence,
    Reply,
    Shutdown,
    WorkerMessage,
    WorkerReady,
)
from inference.executor.worker import WorkerArgs, worker_main
from inference.layers.kv_cache import kv_block_bytes
from inference.lora.request import LoRARequest
from inference.lora.slots import LoRASlotTable
from inference.models.config import ModelConfig
from inference.parallel_state import free_local_port, kv_head_range
from inference.runner.step_inputs import build_step_inputs
from inference.sampler import SamplerOutput, SamplingMetadata
from inference.sequence import Sequence

logger = logging.getLogger(__name__)

# Kept set on multi-GPU hosts where NVLink multicast (NVLS) is unavailable to us.
WORKER_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# Messages up to this size are written from the calling thread: with at most a couple of
# steps in flight they always fit the pipe's buffer, so the write cannot block on a worker
# that is stuck. Larger ones go through a sender thread.
_INLINE_SEND_BYTES = 32 << 10
# After a first sign of failure, how long to wait for the other workers' news (a killed
# rank's peers fail a moment later); the root cause is reported, not its echo.
_FAILURE_SETTLE_S = 0.5
_SHUTDOWN_GRACE_S = 5.0


class MultiprocExecutor:
    # A step's result may send on the workers' pipe (``Flush``), which launches also use.
    concurrent_results = False

    def __init__(
        self,
        config: ResolvedEngineConfig,
        model_config: ModelConfig,
        model_path: str,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.world_size = config.tensor_parallel_size
        self.block_size = config.block_size
        self._dead_reason: str | None = None
        self._closed = False
        context = multiprocessing.get_context("spawn")
        port = free_local_port()
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self._conns = []
        for rank in range(self.world_size):
            engine_end, worker_end = context.Pipe(duplex=True)
            args = WorkerArgs(
                rank=rank, world_size=self.world_size, port=port, config=config,
                model_config=model_config, model_path=model_path, parent_pid=os.getpid(),
                env=dict(WORKER_ENV),
            )
            # Not daemonic: the serving front end may run the engine in a child process,
            # and daemonic processes cannot have children. Cleanup is ours (close()).
            process = context.Process(
                target=worker_main, args=(args, worker_end), name=f"pagoda-tp{rank}",
                daemon=False,
            )
            process.start()
            worker_end.close()
            self.processes.append(process)
            self._conns.append(engine_end)
        # Runs at interpreter exit too, before multiprocessing joins its children.
        self._finalizer = weakref.finalize(
            self, _stop_workers, self.processes, self._conns, _SHUTDOWN_GRACE_S
        )
        self._sender = _Sender(self._conns)
        # Rank 0's step replies arrive in launch order; handles may be collected late.
        self._num_launched = 0
        self._num_received = 0
        self._step_results: dict[int, SamplerOutput | None] = {}
        # Sequences whose sampling state the workers hold, by id, until they finish.
        self._known: dict[int, Sequence] = {}
        # LoRA: slots are decided here, once, and every worker applies the same loads.
        self._lora_table = LoRASlotTable(config.max_loras) if config.enable_lora else None
        # Each worker says it is ready once its shard is loaded.
        ready: list[WorkerReady] = self._call_all(None)
        self.load_seconds = max(r.load_seconds for r in ready)
        logger.info(
            "tensor parallel: %d workers up (pids %s)", self.world_size,
            [r.pid for r in ready],
        )

    # -- the ModelExecutor interface ---------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        """One rank's bytes per block (every rank holds the same number of KV heads)."""
        cfg = self.model_config
        _, heads = kv_head_range(cfg.num_kv_heads, 0, self.world_size)
        return kv_block_bytes(cfg.num_layers, self.block_size, heads, cfg.head_dim,
                              self.config.kv_cache_torch_dtype)  # fmt: skip

    def determine_num_blocks(self) -> int:
        return self._call_all(DetermineNumBlocks())[0]

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._call_all(AllocateKvCache(num_blocks))

    def capture_graphs(self) -> float:
        return max(self._call_all(CaptureGraphs()))

    def launch(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        sample_rows: list[int],
        sampling: SamplingMetadata,
    ) -> _StepHandle:
        """Send the step to every worker and return; ``result()`` waits for rank 0."""
        self._check_alive()
        inputs = build_step_inputs(seqs, num_new_tokens, self.block_size, self._lora_table)
        # Workers keep each sampled sequence's SamplingParams (sent once: pickling them
        # every step would cost milliseconds at large batches) and, for seeded requests,
        # their own generator (torch.Generator objects do not pickle), until it finishes.
        seq_ids: list[int] = []
        new_seqs: dict[int, NewSequence] = {}
        for row in sample_rows:
            seq = seqs[row]
            seq_ids.append(seq.seq_id)
            if seq.seq_id not in self._known:
                self._known[seq.seq_id] = seq
                seed = None if seq.params.seed is None else seq.params.seed + seq.index
                new_seqs[seq.seq_id] = NewSequence(seq.params, seed)
        finished = [seq_id for seq_id, seq in self._known.items() if seq.is_finished]
        for seq_id in finished:
            del self._known[seq_id]
        # Structured outputs: the engine fills the grammar bitmask here and every rank
        # applies the same one, so all ranks still sample identically.
        sampling.resolve_token_bitmask()
        wire = replace(sampling, params=[], generators=[])
        self._send(ExecuteStep(inputs, sample_rows, wire, seq_ids, new_seqs, finished))
        index = self._num_launched
        self._num_launched += 1
        return _StepHandle(self, index)

    def prefetch_lora(self, request: LoRARequest) -> None:
        """Nothing ahead of time here: each worker reads an adapter's shard when a step
        first loads it into a slot."""

    def forget_lora(self, request: LoRARequest) -> None:
        """An adapter was unloaded: its slot is free (workers overwrite it when reused)."""
        if self._lora_table is not None:
            self._lora_table.forget(request)

    def _step_result(self, index: int) -> SamplerOutput | None:
        if self._num_received <= index and self._num_launched == index + 1:
            # No later step was sent: workers answer a step once the next is queued, so
            # ask for this one now.
            self._check_alive()
            self._send(Flush())
        while self._num_received <= index:
            self._check_alive()
            self._step_results[self._num_received] = self._receive({0})[0]
            self._num_received += 1
        return self._step_results.pop(index)

    def close(self) -> None:
        """Stop the workers (politely, then by force); safe to call more than once."""
        self._closed = True
        self._sender.stop()
        self._finalizer()

    # -- health ---------------------------------------------------------------------------
    @property
    def dead_reason(self) -> str | None:
        """Why the executor failed, or None while every worker is up. Noticing a death
        here (between steps) also fails the executor."""
        if self._dead_reason is None and not self._closed:
            for rank, process in enumerate(self.processes):
                if process.exitcode is not None:
                    self._mark_failed(self._describe_death(rank))
                    break
        return self._dead_reason

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and not self._closed

    def _check_alive(self) -> None:
        if self._closed:
            raise RuntimeError("the tensor-parallel executor is closed")
        if self._dead_reason is not None:
            raise RuntimeError(self._dead_reason)

    # -- messaging ------------------------------------------------------------------------
    def _send(self, message: WorkerMessage) -> None:
        payload = pickle.dumps(message, protocol=5)
        self._sender.send(payload)

    def _call_all(self, message: WorkerMessage | None) -> list:
        """Send ``message`` (None: nothing, just collect) and return every rank's reply."""
        self._check_alive()
        if message is not None:
            self._send(message)
        replies = self._receive(set(range(self.world_size)))
        return [replies[rank] for rank in range(self.world_size)]

    def _receive(self, ranks: set[int]) -> dict[int, object]:
        """One reply from each of ``ranks``, watching every worker: a death or an error
        reply from any rank fails the executor."""
        replies: dict[int, object] = {}
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes)}
        conns = {id(c): rank for rank, c in enumerate(self._conns)}
        while len(replies) < len(ranks):
            ready = wait([*self._conns, *sentinels])
            for obj in ready:
                if isinstance(obj, int):  # a sentinel: handled below
                    continue
                rank = conns[id(obj)]
                try:
                    reply = obj.recv()
                except (EOFError, OSError):
                    continue  # its sentinel tells what happened
                if not isinstance(reply, Reply):
                    self._fail_after_settling({rank: reply.text})
                if rank not in ranks or rank in replies:
                    self._fail(f"tensor-parallel worker rank {rank} sent an unexpected reply")
                replies[rank] = reply.value
            if any(isinstance(obj, int) for obj in ready) and len(replies) < len(ranks):
                self._fail_after_settling({})
        return replies

    def _fail_after_settling(self, errors: dict[int, str]) -> None:
        """Collect what the workers have to say for a moment, then fail with the root
        cause: a rank that died without a word (killed) before one that reported an
        exception (often just a peer's collective breaking)."""
        ended = set(wait([p.sentinel for p in self.processes], timeout=_FAILURE_SETTLE_S))
        for process in self.processes:
            if process.sentinel in ended:
                # Its sentinel closes a moment before the process can be reaped.
                process.join(timeout=1.0)
        for rank, conn in enumerate(self._conns):
            try:
                while rank not in errors and conn.poll():
                    reply = conn.recv()
                    if not isinstance(reply, Reply):
                        errors[rank] = reply.text
            except (EOFError, OSError):
                pass
        silent = [
            rank for rank, p in enumerate(self.processes)
            if p.exitcode is not None and rank not in errors
        ]
        if silent:
            reason = self._describe_death(silent[0])
        elif errors:
            rank = min(errors)
            reason = (
                f"tensor-parallel worker rank {rank} (pid {self.processes[rank].pid}) "
                f"{errors[rank]}"
            )
        else:
            reason = "tensor-parallel workers stopped responding"
        self._fail(reason)

    def _describe_death(self, rank: int) -> str:
        process = self.processes[rank]
        code = process.exitcode
        if code is not None and code < 0:
            how = f"was killed by signal {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        return (
            f"tensor-parallel worker rank {rank} (pid {process.pid}) {how}; "
            "the engine cannot continue"
        )

    def _fail(self, reason: str) -> None:
        """Record the failure, kill every worker, raise. Later calls raise the same."""
        self._mark_failed(reason)
        raise RuntimeError(self._dead_reason)

    def _mark_failed(self, reason: str) -> None:
        if self._dead_reason is None:
            self._dead_reason = reason
            logger.error("%s; stopping the remaining workers", reason)
            self._sender.stop()
            _kill_workers(self.processes)


class _StepHandle:
    """A launched step; ``result()`` waits for rank 0's sampled tokens. The hidden states
    stay in the workers (speculative decoding runs on one GPU)."""

    __slots__ = ("_executor", "_index")
    hidden_states = None

    def __init__(self, executor: MultiprocExecutor, index: int) -> None:
        self._executor, self._index = executor, index

    def result(self) -> SamplerOutput | None:
        return self._executor._step_result(self._index)


class _Sender:
    """Writes each message to every worker's pipe, in order. Small messages are written
    by the caller; large ones by a thread, so that a worker stuck in a collective (its
    peer died) can never block the engine, which then notices the death and moves on."""

    def __init__(self, conns: list) -> None:
        self._conns = conns
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0
        self._thread: threading.Thread | None = None

    def send(self, payload: bytes) -> None:
        with self._lock:
            inline = self._pending == 0 and len(payload) <= _INLINE_SEND_BYTES
            if not inline:
                self._pending += 1
        if inline:
            self._write(payload)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tp-sender", daemon=True)
            self._thread.start()
        self._queue.put(payload)

    def _run(self) -> None:
        while (payload := self._queue.get()) is not None:
            self._write(payload)
            with self._lock:
                self._pending -= 1

    def _write(self, payload: bytes) -> None:
        for conn in self._conns:
            try:
                conn.send_bytes(payload)
            except OSError:
                pass  # a dead worker: the reply wait sees its sentinel

    def stop(self) -> None:
        """Finish the queued writes (briefly: a stuck worker is about to be killed)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=1.0)


def _kill_workers(processes: list) -> None:
    for process in processes:
        if process.exitcode is None:
            process.kill()
    for process in processes:
        process.join(timeout=5.0)


def _stop_workers(processes: list, conns: list, grace_s: float) -> None:
    """Ask every worker to stop; terminate, then kill, those that do not within grace."""
    message = pickle.dumps(Shutdown(), protocol=5)
    for conn in conns:
        try:
            conn.send_bytes(message)
        except OSError:
            pass
    for conn in conns:
        conn.close()  # a worker that misses the message stops on EOF
    _join_all(processes, grace_s)
    for process in processes:
        if process.exitcode is None:
            process.terminate()
    _join_all(processes, 2.0)
    _kill_workers(processes)


def _join_all(processes: list, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
