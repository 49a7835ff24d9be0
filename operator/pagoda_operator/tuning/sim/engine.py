"""One engine replica as a fixed-timestep model, calibrated on our H200 bench numbers.

Calibration (Qwen2.5-1.5B shape, bf16, one H200; inference/bench/results/
latency_qwen2.5-1.5b_seqs256.json, prompts of 512 tokens and 128 output tokens):

- decode step time (TPOT) by batch size: 2.07 / 2.22 / 2.82 / 4.84 / 8.53 ms at
  1 / 8 / 32 / 128 / 256 sequences, interpolated in between, plus the time to read the KV
  cache of contexts longer than the bench's (28 layers x 2 x 2 KV heads x 128 x 2 bytes =
  28,672 bytes a token at ~3.4 TB/s effective);
- prefill: TTFT of 12.5 ms for one 512-token prompt and 391 ms for 256 of them, i.e.
  10 ms + 1 token / 340,000 tok/s;
- KV capacity: 4,558,816 tokens at gpu_memory_utilization 0.9 (141 GB card, 4.4 GB of
  weights and activations), linear in the utilization;
- start-up: 11 s engine start + model load + warm-up, 40 s in all.

Above a utilization of 0.945 the model's activation peaks no longer fit: a replica there is
OOM-killed within its first minutes under load, as a real one would be.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

BENCH_BATCH = np.array([1, 8, 32, 128, 256], dtype=float)
BENCH_TPOT_S = np.array([2.065, 2.217, 2.824, 4.844, 8.526]) / 1000
BENCH_CONTEXT = 512 + 64  # the average context during the bench's decode
KV_READ_S_PER_TOKEN = 28_672 / 3.4e12
PREFILL_OVERHEAD_S = 0.010
PREFILL_TOKENS_PER_S = 340_000.0
KV_TOKENS_AT_090 = 4_558_816
GPU_BYTES = 150.1e9
KV_BYTES_PER_TOKEN = 28_672
STARTUP_S = 40.0
OOM_UTILIZATION = 0.945
OOM_AFTER_BUSY_S = 90.0
MAX_PREFILL_TOKENS_PER_STEP = 8192  # the engine's default token budget
CLIENT_TIMEOUT_S = 30.0  # clients (and gateways) give up on a request not started by then


def kv_capacity_tokens(gpu_memory_utilization: float) -> int:
    reserved = 0.9 * GPU_BYTES - KV_TOKENS_AT_090 * KV_BYTES_PER_TOKEN
    return int((gpu_memory_utilization * GPU_BYTES - reserved) / KV_BYTES_PER_TOKEN)


def decode_step_s(batch: int, kv_tokens: float) -> float:
    base = float(np.interp(batch, BENCH_BATCH, BENCH_TPOT_S))
    if batch > BENCH_BATCH[-1]:  # beyond the bench: the last slope, no better
        slope = (BENCH_TPOT_S[-1] - BENCH_TPOT_S[-2]) / (BENCH_BATCH[-1] - BENCH_BATCH[-2])
        base = BENCH_TPOT_S[-1] + slope * (batch - BENCH_BATCH[-1])
    extra_kv = kv_tokens - batch * BENCH_CONTEXT
    return max(base * 0.5, base + KV_READ_S_PER_TOKEN * extra_kv)


def prefill_s(tokens: float) -> float:
    return 0.0 if tokens <= 0 else PREFILL_OVERHEAD_S + tokens / PREFILL_TOKENS_PER_S


@dataclass
class Request:
    arrival: float
    prompt: int
    output: int
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
    def __init__(self, max_num_seqs: int, gpu_memory_utilization: float, ready_at: float):
        self.max_num_seqs = int(max_num_seqs)
        self.gpu_memory_utilization = gpu_memory_utilization
        self.capacity = kv_capacity_tokens(gpu_memory_utilization)
        self.ready_at = ready_at
        self.draining = False
        self.busy_s = 0.0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remaining = np.zeros(0)
        self.context = np.zeros(0)
        self.backlog_s = 0.0  # prefill work carried into the next tick
        self.stats = WindowStats()

    def ready(self, now: float) -> bool:
        return now >= self.ready_at

    @property
    def settings(self) -> tuple[int, float]:
        return self.max_num_seqs, self.gpu_memory_utilization

    def step(self, now: float, dt: float) -> None:
        """Admits, prefills and decodes for one tick of ``dt`` seconds."""
        self._abandon(now)
        prefill_tokens = self._admit(now)
        work_s = self.backlog_s + prefill_s(prefill_tokens)
        decode_time = max(0.0, dt - work_s)
        self.backlog_s = max(0.0, work_s - dt)
        if len(self.running):
            self._decode(decode_time)
            self._preempt_if_full()
            self.busy_s += dt
        self._account(dt)

    def _abandon(self, now: float) -> None:
        """Requests that waited past the client timeout without a first token leave."""
        kept = deque(r for r in self.waiting if r.started or now - r.arrival < CLIENT_TIMEOUT_S)
        self.stats.aborted += len(self.waiting) - len(kept)
        self.waiting = kept

    def _admit(self, now: float) -> int:
        tokens = 0
        budget_s = 0.0
        used = float(self.context.sum())
        added_remaining, added_context = [], []
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if used + request.prompt > self.capacity:
                break
            self.waiting.popleft()
            tokens += request.prompt
            budget_s += request.prompt / PREFILL_TOKENS_PER_S
            used += request.prompt
            if not request.started:
                chunks = 1 + request.prompt // MAX_PREFILL_TOKENS_PER_STEP
                ttft = max(0.0, now - request.arrival) + self.backlog_s + budget_s
                self.stats.ttfts.append(ttft + chunks * PREFILL_OVERHEAD_S)
                self.stats.prompt_tokens += request.prompt
                request.started = True
            self.running.append(request)
            added_remaining.append(request.output)
            added_context.append(request.prompt)
        if added_remaining:
            self.remaining = np.concatenate([self.remaining, added_remaining])
            self.context = np.concatenate([self.context, added_context])
        return tokens

    def _decode(self, seconds: float) -> None:
        step = decode_step_s(len(self.running), float(self.context.sum()))
        steps = seconds / step
        progress = np.minimum(self.remaining, steps)
        self.remaining -= progress
        self.context += progress
        self.stats.generated += float(progress.sum())
        self.stats.itl_s += step * len(self.running)
        self.stats.itl_weight += len(self.running)
        done = self.remaining <= 1e-9
        if done.any():
            self.stats.finished += int(done.sum())
            keep = ~done
            self.running = [r for r, k in zip(self.running, keep) if k]
            self.remaining, self.context = self.remaining[keep], self.context[keep]

    def _preempt_if_full(self) -> None:
        """Recompute-style preemption of the newest sequences, as the engine does."""
        while len(self.running) > 1 and self.context.sum() > self.capacity:
            request = self.running.pop()
            request.prompt = int(self.context[-1])
            request.output = max(1, int(np.ceil(self.remaining[-1])))
            self.remaining, self.context = self.remaining[:-1], self.context[:-1]
            self.waiting.appendleft(request)
            self.stats.preemptions += 1

    def _account(self, dt: float) -> None:
        stats = self.stats
        stats.seconds += dt
        stats.kv_usage_s += dt * float(self.context.sum()) / self.capacity
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
        self.remaining, self.context = np.zeros(0), np.zeros(0)
        return requests
