"""A tensor-parallel worker: one process per GPU (or per CPU rank under gloo).

It joins the process group, loads its shard of the model into a ``ModelRunner`` and then
serves the engine's messages (``messages``) over its pipe until told to stop or until the
pipe closes (the engine exited or was killed: a worker never outlives its engine).

Every rank runs every step the same way, sampler included: the logits are all-gathered,
so each rank holds the full distribution, and with the same seeds and the same calls each
samples the same tokens (the next step's inputs may refer to them on the device). Only
rank 0 replies to a step; every rank replies to the set-up calls, and any rank reports an
exception before exiting.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any

import torch

from inference.config import ResolvedEngineConfig
from inference.executor.messages import (
    AllocateKvCache,
    CaptureGraphs,
    DetermineNumBlocks,
    ExecuteStep,
    Flush,
    Reply,
    SetupCall,
    Shutdown,
    WorkerFailed,
    WorkerReady,
)
from inference.models.config import ModelConfig


@dataclass
class WorkerArgs:
    rank: int
    world_size: int
    port: int  # TCP rendezvous of the process group on 127.0.0.1
    config: ResolvedEngineConfig
    model_config: ModelConfig
    model_path: str
    parent_pid: int
    env: dict[str, str]  # set (if unset) before anything touches NCCL


# "FILE[:FIRST[:COUNT]]": rank 0 runs torch.profiler over steps FIRST .. FIRST+COUNT-1
# (default 200 and 50) and writes its kernels, ranked by GPU time, to FILE.
PROFILE_ENV = "PAGODA_WORKER_PROFILE"


def worker_main(args: WorkerArgs, conn) -> None:
    for key, value in args.env.items():
        os.environ.setdefault(key, value)
    # Ctrl-C reaches the whole process group; the engine decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(args.parent_pid)
    try:
        worker = _Worker(args, conn)
    except BaseException:
        _report_and_exit(conn, "failed to start")
    try:
        worker.serve()
    except BaseException:
        _report_and_exit(conn, "failed")
    worker.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Straight out: interpreter teardown (library threads, atexit hooks) only adds delay.
    os._exit(0)


def _report_and_exit(conn, what: str) -> None:
    error = sys.exc_info()[1]
    text = f"{what}: {type(error).__name__}: {error}\n\nworker traceback:\n"
    try:
        conn.send(WorkerFailed(text + traceback.format_exc()))
    except OSError:
        pass
    sys.stderr.flush()
    # Not sys.exit: a process-group teardown could block on peers that are gone.
    os._exit(1)


def _exit_with_parent(parent_pid: int) -> None:
    """A worker stuck in a collective does not read its pipe, so EOF alone cannot stop it
    when the engine dies: watch the parent too."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


class _Worker:
    def __init__(self, args: WorkerArgs, conn) -> None:
        from inference.parallel_state import init_parallel, with_small_all_reduce
        from inference.runner.model_runner import ModelRunner

        self.rank = args.rank
        self.conn = conn
        device_type = args.config.device
        if device_type == "cuda":
            torch.cuda.set_device(args.rank)
            self.device = torch.device("cuda", args.rank)
        else:
            # Ranks share the host's cores: do not oversubscribe them.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
            self.device = torch.device("cpu")
        # Same seed on every rank: the same calls then draw the same numbers (dummy weights
        # of equal-shaped shards, unseeded sampling).
        torch.manual_seed(args.config.seed)
        self.parallel = with_small_all_reduce(
            init_parallel(args.rank, args.world_size, args.port, device_type),
            self.device, args.config.torch_dtype,
        )
        self.runner = ModelRunner(
            args.config, args.model_config, args.model_path, self.parallel, self.device
        )
        # Sampling state of the engine's live sequences, by id: (params, seeded generator).
        self.sequences: dict[int, tuple[Any, torch.Generator | None]] = {}
        conn.send(Reply(WorkerReady(self.runner.load_seconds, os.getpid())))

    def serve(self) -> None:
        """Steps are pipelined: step n is answered once step n+1 is queued on the GPU (or
        on ``Flush``), so the GPU never idles while this process reads the next message and
        stages its inputs."""
        conn = self.conn
        pending = None  # the last launched step, not answered yet
        profiler = _StepProfiler.from_env() if self.rank == 0 else None
        while True:
            try:
                message = pickle.loads(conn.recv_bytes())
            except EOFError:
                return  # the engine is gone
            if isinstance(message, ExecuteStep):
                if profiler is not None:
                    profiler.before_step()
                launched = self.launch(message)
                if pending is not None:
                    self._answer(pending)
                pending = launched
            elif isinstance(message, Flush):
                if pending is not None:
                    self._answer(pending)
                    pending = None
            elif isinstance(message, Shutdown):
                return
            elif isinstance(message, SetupCall):
                conn.send(Reply(self.set_up(message)))
            else:
                raise ValueError(f"unknown message {message!r}")

    # -- set-up calls (every rank replies) ----------------------------------------------
    def set_up(self, call: SetupCall) -> Any:
        if isinstance(call, DetermineNumBlocks):
            # Every rank must hold the same number of blocks: the smallest that fits
            # everywhere.
            return self.parallel.all_reduce_min(self.runner.determine_num_blocks())
        if isinstance(call, AllocateKvCache):
            return self.runner.allocate_kv_cache(call.num_blocks)
        if isinstance(call, CaptureGraphs):
            return self.runner.capture_graphs()
        raise ValueError(f"unknown set-up call {call!r}")

    # -- one step ------------------------------------------------------------------------
    def _answer(self, handle: Any) -> None:
        # Every rank waits for its step (so that its pinned staging buffers are free again
        # two steps later); rank 0 sends the sampled tokens.
        result = handle.result()
        if self.rank == 0:
            self.conn.send(Reply(result))

    def launch(self, step: ExecuteStep) -> Any:
        """``step.sampling`` arrives without params and generators: they are looked up by
        the sampled rows' sequence ids (``new_seqs`` brings those seen for the first time)."""
        for seq_id in step.finished:
            self.sequences.pop(seq_id, None)
        for seq_id, new in step.new_seqs.items():
            generator = None
            if new.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(new.seed)
            self.sequences[seq_id] = (new.params, generator)
        states = [self.sequences[seq_id] for seq_id in step.seq_ids]
        drafts = step.sampling.draft_token_ids
        if drafts is not None:  # a verify step: a row per position each sequence verifies
            states = [state for state, row_drafts in zip(states, drafts, strict=True)
                      for _ in range(len(row_drafts) + 1)]  # fmt: skip
        sampling = replace(
            step.sampling, params=[s[0] for s in states], generators=[s[1] for s in states]
        )
        return self.runner.launch_inputs(step.inputs, step.sample_rows, sampling)

    def close(self) -> None:
        from inference.parallel_state import destroy_parallel

        destroy_parallel(self.parallel)


class _StepProfiler:
    """Where one rank's step time goes (see ``PROFILE_ENV``): a worker is its own process,
    out of reach of a profiler started in the engine."""

    def __init__(self, path: str, first: int, count: int) -> None:
        self.path, self.first, self.count = path, first, count
        self.step = 0
        self.profile: Any = None
        self.start = 0.0

    @classmethod
    def from_env(cls) -> _StepProfiler | None:
        spec = os.environ.get(PROFILE_ENV)
        if not spec:
            return None
        path, *numbers = spec.split(":")
        first, count = ([int(n) for n in numbers] + [200, 50][len(numbers):])[:2]
        return cls(path, first, count)

    def before_step(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        cuda = torch.cuda.is_available()
        if self.step == self.first:
            if cuda:
                torch.cuda.synchronize()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            self.profile = profile(activities=activities)
            self.profile.__enter__()
            self.start = time.perf_counter()
        elif self.step == self.first + self.count and self.profile is not None:
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - self.start
            self.profile.__exit__(None, None, None)
            self._write(wall)
            self.profile = None
        self.step += 1

    def _write(self, wall: float) -> None:
        averages = self.profile.key_averages()
        kernels = [e for e in averages if e.device_type.name == "CUDA"]
        if kernels:  # GPU kernels by device time
            rows = [(e.self_device_time_total, e.count, e.key) for e in kernels]
            busy_us = sum(r[0] for r in rows)
            what = f"GPU busy {busy_us / self.count / 1e3:.3f} ms/step ({busy_us / 1e6 / wall:.0%})"
        else:  # CPU ranks: operators by their own CPU time
            rows = [(e.self_cpu_time_total, e.count, e.key) for e in averages]
            what = "CPU operators by self time"
        rows.sort(reverse=True)
        lines = [
            f"rank 0, steps {self.first}..{self.first + self.count - 1}: "
            f"{wall / self.count * 1e3:.3f} ms/step wall, {what}",
            f"{'us/step':>9} {'calls/step':>10} {'us/call':>8}  name",
        ]
        for total_us, count, key in rows[:25]:
            lines.append(
                f"{total_us / self.count:9.1f} {count / self.count:10.1f} "
                f"{total_us / max(count, 1):8.1f}  {key[:90]}"
            )
        with open(self.path, "w") as f:
            f.write("\n".join(lines) + "\n")
