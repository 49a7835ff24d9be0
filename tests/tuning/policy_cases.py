"""Builders for the policy tests: a healthy window, the user's limits, a run of windows."""

from __future__ import annotations

import dataclasses
from typing import Any

from pagoda_operator.tuning.policy import (
    GPU_MEMORY_UTILIZATION,
    MAX_NUM_SEQS,
    REPLICAS,
    Decision,
    Limits,
    Snapshot,
    decide,
)
from pagoda_operator.tuning.state import TunerState

WINDOW_S = 60.0
COOLDOWN_S = 300.0


def window(**changes: Any) -> Snapshot:
    """A healthy window of two engines at moderate load, with ``changes`` applied."""
    healthy = Snapshot(
        window_s=WINDOW_S,
        pods=2,
        kv_cache_usage=0.3,
        requests_waiting=0.0,
        requests_running=60.0,
        preemptions_per_s=0.0,
        ttft_p95_s=0.4,
        itl_p95_s=0.01,
        generation_tokens_per_s=5000.0,
        requests_per_s=20.0,
        restarts=0.0,
        oom_kills=0.0,
    )
    return dataclasses.replace(healthy, **changes)


def settings(replicas: int = 2, seqs: int = 64, memory: float = 0.9) -> dict[str, float]:
    return {REPLICAS: replicas, MAX_NUM_SEQS: seqs, GPU_MEMORY_UTILIZATION: memory}


def limits(**changes: Any) -> Limits:
    base = Limits(
        bounds={
            REPLICAS: (1, 8),
            MAX_NUM_SEQS: (8, 256),
            GPU_MEMORY_UTILIZATION: (0.8, 0.95),
        },
        fixed={},
        cooldown_s=COOLDOWN_S,
        ttft_target_s=1.0,
    )
    return dataclasses.replace(base, **changes)


# Windows that each call for one rule, once they have lasted long enough.
# Every slot of 64 busy, a queue, the cache 30 % full; the queue shrinks by 10 req/s, so one
# engine carries the 10 req/s arriving while the other restarts for a bigger batch.
QUEUED_WITH_FREE_KV = window(
    requests_waiting=40.0, requests_running=128.0, ttft_p95_s=2.5, queue_growth_per_s=-10.0
)
# The same queue not draining: neither engine may stop, so more engines come first.
QUEUED_STEADY = dataclasses.replace(QUEUED_WITH_FREE_KV, queue_growth_per_s=0.0)
QUEUED_WITH_FULL_KV = window(
    requests_waiting=40.0, requests_running=100.0, kv_cache_usage=0.8, ttft_p95_s=2.5
)
IDLE = window(requests_running=10.0, ttft_p95_s=0.1, requests_per_s=4.0)
PREEMPTING = window(preemptions_per_s=2.0, kv_cache_usage=0.97, requests_running=120.0)
KV_BOUND = window(kv_cache_usage=0.95, requests_waiting=10.0, requests_running=40.0)
OOM = window(oom_kills=1.0, restarts=1.0)


@dataclasses.dataclass
class Run:
    """Feeds windows to ``decide`` one interval apart, applying changes as Auto would.

    ``state`` is kept as ``status.tuning.state`` holds it, read and written back each
    window as the operator does, so every run also checks that the state survives it."""

    settings: dict[str, float]
    limits: Limits
    mode: str = "Auto"
    now: float = 1_000_000.0
    state: dict[str, Any] | None = None
    decisions: list[Decision] = dataclasses.field(default_factory=list)

    def step(self, snapshot: Snapshot | None, *, rollout_complete: bool = True) -> Decision:
        self.now += WINDOW_S
        decision, state = decide(
            snapshot,
            self.settings,
            self.limits,
            TunerState.from_status(self.state),
            now=self.now,
            mode=self.mode,
            rollout_complete=rollout_complete,
            problem="Prometheus unreachable",
        )
        self.state = state.to_status()
        if self.mode == "Auto" and decision.action in ("change", "revert"):
            assert decision.knob is not None and decision.new is not None
            self.settings = {**self.settings, decision.knob: decision.new}
        self.decisions.append(decision)
        return decision

    def until_change(self, snapshot: Snapshot, limit: int = 30) -> Decision:
        for _ in range(limit):
            decision = self.step(snapshot)
            if decision.action != "hold":
                return decision
        raise AssertionError(f"no change after {limit} windows: {self.decisions[-1]}")

    def wait_cooldown(self, snapshot: Snapshot) -> None:
        """Steps through the cooldown (and the watch of the change) with ``snapshot``."""
        for _ in range(int(COOLDOWN_S // WINDOW_S) - 1):
            decision = self.step(snapshot)
            assert decision.action == "hold", decision
