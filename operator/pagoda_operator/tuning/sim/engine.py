"""One engine replica as a fixed-timestep model, calibrated on this engine's H200 numbers.

The numbers come from ``benchmarks/sim_calibration.py`` run on one H200 (random bf16
weights in the exact Qwen2.5 shapes), checked in beside this file as
``sim_calibration_h200.json``; this module fits the model to them and nothing else:

- KV capacity in tokens per ``gpu_memory_utilization``: linear through the measured rows;
- decode step time = a + b x batch + c x KV tokens read, least squares over the measured
  (batch, context) grid;
- prefill of a chunk of n tokens after p tokens of context = a step overhead + n / rate
  + n x (p + n / 2) x k (attention over the context), least squares over the measured
  single prompts, full steps of prompts, and recomputations of 4k and 16k contexts;
- a preemption is a recomputation: the sequence goes back to the head of the queue with its
  whole context as its prompt, and pays its prefill again (no prefix-cache hit: under the
  pressure that preempted it, its blocks are reused at once);
- start-up: the measured engine start (dummy weights) plus the weights read at 2 GB/s and
  20 s for the pod and container.

Not measured, so assumed: above a utilization of 0.95 (the highest the bench profiles) the
activation peaks and CUDA graphs outside the profile no longer fit, and a replica there is
OOM-killed within its first minutes under load. The traces' bounds stay at or below 0.95.

A live change (``Replica.retune``) that raises the batch past the captured CUDA graphs
records the missing graphs in the background, as the engine does
(``inference/runner/cuda_graphs.py``, ``GraphExtension``): steps go on under the old limits
and the new ones apply once the capture is done, after the measured start-up capture time
scaled to the graphs recorded (``graphs_to_capture`` over the start-up's count; each
counted at its start-up cost, warm-up run included, though the engine skips the warm-up of
sizes whose token count already ran). Assumed, not measured: steps run 25 % slower
meanwhile (``CAPTURE_SLOWDOWN``: the capture thread records from Python and shares the
GIL with the step loop). A resized KV cache still captures every graph again while the
engine stalls.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np

CALIBRATION = Path(__file__).with_name("sim_calibration_h200.json")
OOM_UTILIZATION = 0.955
OOM_AFTER_BUSY_S = 90.0
CLIENT_TIMEOUT_S = 30.0  # clients (and gateways) give up on a request not started by then
POD_START_S = 20.0  # scheduling, image and container start before the engine starts
WEIGHT_READ_BYTES_S = 2e9
PARAMS = {"qwen2.5-1.5b": 1.54e9, "qwen2.5-7b": 7.62e9}  # weights read at start-up, bf16
CAPTURE_SLOWDOWN = 1.25  # step times while graphs are recorded in the background (assumed)
# The engine's graph sizes (``inference/runner/cuda_graphs.py``; the operator does not
# import the engine, tests/tuning/test_simulator.py checks the copy).
MIXED_GRAPH_TOKENS = (
    16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 576, 640, 768, 896, 1024, 1280, 1536,
    1792, 2048,
)  # fmt: skip
DECODE_GRAPH_BATCHES = (
    1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640,
    768, 896, 1024,
)  # fmt: skip


def _graph_shapes(max_num_seqs: int, max_num_batched_tokens: int) -> dict[tuple[str, int], int]:
    """The engine's graphs under these limits: (kind, size) -> the rows each holds."""
    batches = {b for b in DECODE_GRAPH_BATCHES if b <= max_num_seqs} | {max_num_seqs}
    shapes = {("decode", b): b for b in batches}
    return shapes | {("mixed", t): max_num_seqs + 1 for t in MIXED_GRAPH_TOKENS
                     if t <= max_num_batched_tokens}  # fmt: skip


def graphs_to_capture(have: dict[tuple[str, int], int], max_num_seqs: int,
                      max_num_batched_tokens: int) -> dict[tuple[str, int], int]:  # fmt: skip
    """The graphs the engine records for a raise to ``max_num_seqs`` (its
    ``missing_shapes``): those it lacks, and mixed ones with too few rows for the
    sequences a step of their size may now hold."""
    want = _graph_shapes(max_num_seqs, max_num_batched_tokens)
    return {shape: rows for shape, rows in want.items()
            if have.get(shape, 0) < (rows if shape[0] == "decode" else
                                     min(shape[1], max_num_seqs) + 1)}  # fmt: skip


@dataclass(frozen=True)
class EngineModel:
    """One model shape on one card, fitted to the calibration file."""

    name: str
    kv_bytes_per_token: int
    kv_rows: tuple[tuple[float, int], ...]  # (gpu_memory_utilization, KV tokens)
    decode: tuple[float, float, float]  # seconds: fixed, per sequence, per KV token read
    prefill: tuple[float, float, float]  # seconds: per step, per token, per token x context
    max_num_batched_tokens: int
    startup_s: float
    provisional: bool
    # CUDA-graph capture (measured), of ``capture_graphs`` graphs (the bench's limits): a
    # live KV resize stalls the engine this long (every graph again), a raise past the
    # captured batch records its missing graphs in the background for their share. The
    # calibration's ``recapture_s`` where it has one (every graph captured again in the
    # running engine, its kernels compiled: what a live change pays), else the start-up
    # capture (which compiles the kernels first: an upper bound).
    capture_s: float = 0.0
    capture_graphs: int = 1

    def kv_capacity_tokens(self, gpu_memory_utilization: float) -> int:
        us, tokens = zip(*self.kv_rows)
        slope = (tokens[-1] - tokens[0]) / (us[-1] - us[0])
        return int(tokens[0] + slope * (gpu_memory_utilization - us[0]))

    def decode_step_s(self, batch: int, kv_tokens: float) -> float:
        fixed, per_seq, per_kv = self.decode
        return fixed + per_seq * batch + per_kv * kv_tokens

    def prefill_s(self, tokens: float, context: float = 0.0) -> float:
        """Prefill of ``tokens`` new tokens of one sequence after ``context`` cached ones,
        in chunks of the step's token budget (each chunk a step's overhead)."""
        if tokens <= 0:
            return 0.0
        step, per_token, per_pair = self.prefill
        return self.prefill_work_s(tokens, context) + step * -(-tokens // self.max_num_batched_tokens)

    def prefill_work_s(self, tokens: float, context: float = 0.0) -> float:
        """The same without the per-step overhead (a chunk sharing a step with others)."""
        _, per_token, per_pair = self.prefill
        return tokens * per_token + tokens * (context + tokens / 2) * per_pair


def fit(name: str, measured: dict, provisional: bool = False) -> EngineModel:
    kv_rows = tuple(sorted((row["gpu_memory_utilization"], row["tokens"])
                           for row in measured["kv_capacity"]))  # fmt: skip
    decode_rows = measured["decode"]
    a = np.array([[1.0, row["batch"], row["batch"] * row["context"]] for row in decode_rows])
    t = np.array([row["step_ms"] / 1e3 for row in decode_rows])
    decode = _nonnegative_fit(a, t)
    budget = measured["max_num_batched_tokens"]
    equations, seconds = [], []
    for row in measured["prefill"]:
        n, length = row["prompts"], row["chunk"]
        equations.append([-(-n * length // budget), n * length, n * length * length / 2])
        seconds.append(row["seconds"])
    for row in measured["recompute"]:
        length = row["context"]
        equations.append([-(-length // budget), length, length * length / 2])
        seconds.append(row["seconds"])
    prefill = _nonnegative_fit(np.array(equations, dtype=float), np.array(seconds))
    weights_s = PARAMS.get(name, 0.0) * 2 / WEIGHT_READ_BYTES_S
    return EngineModel(
        name, measured["kv_bytes_per_token"], kv_rows, decode, prefill, budget,
        POD_START_S + measured["startup_s"] + weights_s, provisional,
        float(measured.get("recapture_s")
              or (measured.get("startup_phases") or {}).get("capture_s", 0.0)),
        len(_graph_shapes(measured["max_num_seqs"], budget)),
    )  # fmt: skip


def _nonnegative_fit(a: np.ndarray, t: np.ndarray) -> tuple[float, float, float]:
    """Least squares on relative error (each row divided by its time), coefficients >= 0."""
    scaled = a / t[:, None]
    coef, *_ = np.linalg.lstsq(scaled, np.ones(len(t)), rcond=None)
    while (coef < 0).any():  # drop a negative term and refit the rest
        keep = coef > 0
        coef = np.zeros_like(coef)
        coef[keep] = np.linalg.lstsq(scaled[:, keep], np.ones(len(t)), rcond=None)[0]
    return tuple(float(c) for c in coef)  # type: ignore[return-value]


@cache
def engine_model(name: str) -> EngineModel:
    data = json.loads(CALIBRATION.read_text())
    return fit(name, data["models"][name], bool(data.get("provisional")))


@dataclass
class Request:
    arrival: float
    prompt: int
    output: int
    prefix: int = -1  # the shared prompt prefix it starts with (a tenant's), -1 for none
    prefix_len: int = 0
    started: bool = False  # has its first token (a preempted request keeps it)


@dataclass
class WindowStats:
    """What one replica's /metrics would show over a window."""

    seconds: float = 0.0
    kv_usage_s: float = 0.0  # integrals over time, divided by ``seconds`` when read
    waiting_s: float = 0.0
    running_s: float = 0.0
    preemptions: int = 0
    generated: float = 0.0
    finished: int = 0
    aborted: int = 0  # given up on while waiting
    prompt_tokens: int = 0  # of requests started in the window
    waiting_at_start: int = 0
    waiting_at_end: int = 0
    ttfts: list[float] = field(default_factory=list)
    itl_s: float = 0.0  # step-time weighted by running sequences
    itl_weight: float = 0.0


class Replica:
    """One engine: FCFS admission while ``max_num_seqs`` and the KV cache allow, chunked
    prefill sharing steps with decode, recompute preemption of the newest sequence when the
    cache runs out, and a prefix cache: a shared prefix in use (or cached and not yet
    evicted) is neither prefilled nor stored again."""

    def __init__(self, model: EngineModel, max_num_seqs: int, gpu_memory_utilization: float,
                 ready_at: float):  # fmt: skip
        self.model = model
        self.max_num_seqs = int(max_num_seqs)
        self.gpu_memory_utilization = gpu_memory_utilization
        self.capacity = model.kv_capacity_tokens(gpu_memory_utilization)
        self.ready_at = ready_at
        self.graphs = _graph_shapes(self.max_num_seqs, model.max_num_batched_tokens)
        # A live change waiting for its graphs: (max_num_seqs, utilization, in effect at).
        self.pending: tuple[int, float, float] | None = None
        self.draining = False
        self.drain_deadline = float("inf")
        self.busy_s = 0.0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remaining = np.zeros(0)
        self.context = np.zeros(0)
        self.shared = np.zeros(0)  # tokens of each sequence's context held by a shared prefix
        self.prefix_users: dict[int, int] = {}  # prefix -> running sequences using it
        self.cached: dict[int, int] = {}  # prefix -> length, held in the cache
        self.backlog_s = 0.0  # work carried into the next tick
        self.stats = WindowStats()

    def ready(self, now: float) -> bool:
        return now >= self.ready_at

    def retune(self, max_num_seqs: int, gpu_memory_utilization: float,
               now: float) -> tuple[float, float]:  # fmt: skip
        """A live change (the admin API). A KV cache reallocated captures every graph
        again, stalling the engine for the whole capture; a batch past the captured graphs
        records the missing ones in the background (steps go on under the old limits,
        ``CAPTURE_SLOWDOWN`` slower) and applies at the first step after; anything else
        costs a step. Nothing is dropped: a cache that shrinks under its sequences preempts
        the newest, as when it runs out. Returns (seconds until it is in effect, when the
        admin API answers; seconds the engine stalled)."""
        model, max_num_seqs = self.model, int(max_num_seqs)
        per_graph = model.capture_s / model.capture_graphs
        if gpu_memory_utilization != self.gpu_memory_utilization:
            self.graphs = _graph_shapes(max_num_seqs, model.max_num_batched_tokens)
            stall = per_graph * len(self.graphs)
        else:
            missing = graphs_to_capture(self.graphs, max_num_seqs, model.max_num_batched_tokens)
            if missing:
                capture_s = per_graph * len(missing)
                self.graphs = self.graphs | missing
                self.pending = (max_num_seqs, gpu_memory_utilization, now + capture_s)
                return capture_s, 0.0
            stall = model.decode_step_s(1, 0.0)
        self._set_limits(max_num_seqs, gpu_memory_utilization)
        self.backlog_s += stall
        return stall, stall

    def _set_limits(self, max_num_seqs: int, gpu_memory_utilization: float) -> None:
        self.max_num_seqs = max_num_seqs
        self.gpu_memory_utilization = gpu_memory_utilization
        self.capacity = self.model.kv_capacity_tokens(gpu_memory_utilization)

    def capturing(self, now: float) -> bool:
        """Graphs are being recorded in the background (at the start of this tick)."""
        return self.pending is not None and now < self.pending[2]

    @property
    def settings(self) -> tuple[int, float]:
        return self.max_num_seqs, self.gpu_memory_utilization

    def kv_used(self) -> float:
        """Tokens in the KV cache that running sequences hold (shared prefixes once)."""
        in_use = sum(self.cached[p] for p, n in self.prefix_users.items() if n > 0)
        return float((self.context - self.shared).sum()) + in_use

    def step(self, now: float, dt: float) -> None:
        """Admits, prefills and decodes for one tick of ``dt`` seconds: each step holding a
        prompt chunk decodes the running batch too, the rest of the tick is decode steps."""
        if self.pending is not None and now >= self.pending[2]:  # the graphs are ready
            self._set_limits(*self.pending[:2])
            self.pending = None
        self._abandon(now)
        slowdown = CAPTURE_SLOWDOWN if self.capturing(now) else 1.0
        step_s = self.model.decode_step_s(len(self.running), float(self.context.sum()))
        chunks, prefill_work = self._admit(now, dt, step_s * slowdown, slowdown)
        work_s = self.backlog_s + prefill_work + chunks * step_s * slowdown
        self.backlog_s = max(0.0, work_s - dt)
        if len(self.running):
            step_s = self.model.decode_step_s(len(self.running), float(self.context.sum()))
            step_s *= slowdown
            self._decode(chunks + max(0.0, dt - work_s) / step_s, step_s)
            self._preempt_if_full()
            self.busy_s += dt
        self._account(dt)

    def _abandon(self, now: float) -> None:
        """Requests that waited past the client timeout without a first token leave."""
        kept = deque(r for r in self.waiting if r.started or now - r.arrival < CLIENT_TIMEOUT_S)
        self.stats.aborted += len(self.waiting) - len(kept)
        self.waiting = kept

    def _admit(self, now: float, dt: float, step_s: float,
               slowdown: float = 1.0) -> tuple[int, float]:  # fmt: skip
        """Admits from the head of the queue while this tick has time for their prefill
        (the engine schedules a prompt only into a step's token budget, so the rest stay
        waiting, as its metrics show); the number of prefill steps and their work."""
        budget = self.model.max_num_batched_tokens
        new_tokens, work_s = 0, 0.0
        used = self.kv_used()
        added: list[tuple[int, int, int]] = []
        while (self.waiting and len(self.running) < self.max_num_seqs
               and self.backlog_s + work_s < dt):  # fmt: skip
            request = self.waiting[0]
            hit = request.prefix >= 0 and request.prefix in self.cached
            shared = request.prefix_len if request.prefix >= 0 else 0
            reused = shared if hit else 0
            held = self.prefix_users.get(request.prefix, 0) > 0
            needed = request.prompt - shared + (0 if held else shared)
            if used + needed > self.capacity:
                self._evict_unused_prefixes()
                used = self.kv_used()
                if used + needed > self.capacity:
                    break
            self.waiting.popleft()
            tokens = request.prompt - reused
            work_s += self.model.prefill_work_s(tokens, reused) * slowdown
            new_tokens += tokens
            used += needed
            if request.prefix >= 0:
                self.cached[request.prefix] = shared
                self.prefix_users[request.prefix] = self.prefix_users.get(request.prefix, 0) + 1
            if not request.started:
                steps = -(-new_tokens // budget)
                ttft = max(0.0, now - request.arrival) + self.backlog_s + work_s + steps * step_s
                self.stats.ttfts.append(ttft)
                self.stats.prompt_tokens += request.prompt
                request.started = True
            self.running.append(request)
            added.append((request.output, request.prompt, shared))
        if added:
            remaining, context, shared_tokens = zip(*added)
            self.remaining = np.concatenate([self.remaining, remaining])
            self.context = np.concatenate([self.context, context])
            self.shared = np.concatenate([self.shared, shared_tokens])
        return -(-new_tokens // budget), work_s

    def _evict_unused_prefixes(self) -> None:
        for prefix in [p for p in self.cached if self.prefix_users.get(p, 0) == 0]:
            del self.cached[prefix]

    def _decode(self, steps: float, step_s: float) -> None:
        progress = np.minimum(self.remaining, steps)
        self.remaining -= progress
        self.context += progress
        self.stats.generated += float(progress.sum())
        self.stats.itl_s += step_s * len(self.running)
        self.stats.itl_weight += len(self.running)
        done = self.remaining <= 1e-9
        if done.any():
            self.stats.finished += int(done.sum())
            for request in (r for r, d in zip(self.running, done) if d):
                self._release_prefix(request)
            keep = ~done
            self.running = [r for r, k in zip(self.running, keep) if k]
            self._keep(keep)

    def _keep(self, keep: np.ndarray) -> None:
        self.remaining, self.context = self.remaining[keep], self.context[keep]
        self.shared = self.shared[keep]

    def _release_prefix(self, request: Request) -> None:
        if request.prefix >= 0:
            self.prefix_users[request.prefix] -= 1

    def _preempt_if_full(self) -> None:
        """Recompute-style preemption of the newest sequences, as the engine does: the
        newest goes back to the head of the queue with its whole context to prefill again."""
        while len(self.running) > 1 and self.kv_used() > self.capacity:
            self._evict_unused_prefixes()
            if self.kv_used() <= self.capacity:
                break
            request = self.running.pop()
            request.prompt = int(self.context[-1])
            request.output = max(1, int(np.ceil(self.remaining[-1])))
            self._release_prefix(request)
            self._keep(np.arange(len(self.running) + 1) < len(self.running))
            self.waiting.appendleft(request)
            self.stats.preemptions += 1

    def _account(self, dt: float) -> None:
        stats = self.stats
        stats.seconds += dt
        stats.kv_usage_s += dt * min(1.0, self.kv_used() / self.capacity)
        stats.waiting_s += dt * len(self.waiting)
        stats.running_s += dt * len(self.running)

    def take_stats(self) -> WindowStats:
        stats = self.stats
        stats.waiting_at_end = len(self.waiting)
        self.stats = WindowStats(waiting_at_start=len(self.waiting))
        return stats

    def oom_due(self) -> bool:
        return self.gpu_memory_utilization > OOM_UTILIZATION and self.busy_s > OOM_AFTER_BUSY_S

    def evict_all(self) -> list[Request]:
        """Every request this replica holds, for the others to take over."""
        requests = list(self.running) + list(self.waiting)
        for request, remaining, context in zip(self.running, self.remaining, self.context):
            request.prompt, request.output = int(context), max(1, int(np.ceil(remaining)))
        self.running, self.waiting = [], deque()
        self.remaining, self.context, self.shared = np.zeros(0), np.zeros(0), np.zeros(0)
        self.prefix_users, self.cached = {}, {}
        return requests
