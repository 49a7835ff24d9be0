"""Replicas behind a Service, a Deployment's rolling update, and the tuner on top.

``simulate`` plays a trace against a static configuration, against the operator's own
``decide`` (Auto mode), or against a queue-driven autoscaler (the HorizontalPodAutoscaler's
algorithm, which a KEDA ScaledObject feeds the same way), every ``interval_s``, with the
metrics an engine would export.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagoda_operator.tuning.policy import (
    GPU_MEMORY_UTILIZATION,
    MAX_NUM_SEQS,
    REPLICAS,
    Limits,
    PolicyConfig,
    Snapshot,
    decide,
)
from pagoda_operator.tuning.sim.engine import (
    CLIENT_TIMEOUT_S,
    EngineModel,
    Replica,
    Request,
    engine_model,
)
from pagoda_operator.tuning.sim.traces import Trace

TICK_S = 0.2
SLO_WINDOW_S = 60.0
PRE_STOP_S = 10.0  # spec.termination defaults: preStopSeconds, drainSeconds
DRAIN_S = 120.0


@dataclass
class Timeline:
    """One row per tuner interval, for plots and for the decision log."""

    time: list[float] = field(default_factory=list)
    replicas: list[int] = field(default_factory=list)
    max_num_seqs: list[int] = field(default_factory=list)
    gpu_memory_utilization: list[float] = field(default_factory=list)
    ttft_p95_s: list[float] = field(default_factory=list)
    rate: list[float] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    ttft_target_s: float = 1.0


@dataclass
class Result:
    gpu_hours: float
    slo_windows_met: int
    slo_windows: int
    timeline: Timeline
    preemptions: int = 0
    rollouts: int = 0  # changes of the Deployment (each one a rolling update or a scale)
    dropped: int = 0  # requests cut off mid-answer when a drain ran out
    live_changes: int = 0  # engine-knob changes made live (not counted in ``rollouts``)
    live_stall_s: float = 0.0  # the engine time they stalled, all engines together

    @property
    def attainment(self) -> float:
        return self.slo_windows_met / max(self.slo_windows, 1)


@dataclass
class QueueAutoscaler:
    """The HorizontalPodAutoscaler's algorithm on waiting requests per replica (KEDA's
    Prometheus trigger with metricType AverageValue hands it the same ratio): desired =
    ceil(current x waiting per replica / target), nothing within a 10 % tolerance, up at
    most to max(2 x current, current + 4) a period, down only to the highest
    recommendation of the last 300 s (the default scale-down stabilization). Replicas still
    starting count as waiting nothing, as the HPA counts unready pods when scaling up."""

    target_waiting: float
    min_replicas: int
    max_replicas: int
    tolerance: float = 0.1
    stabilization_s: float = 300.0
    history: list[tuple[float, int]] = field(default_factory=list)

    def desired(self, current: int, snapshot: Snapshot | None, now: float) -> int:
        recommendation = current
        if snapshot is not None:
            replicas = max(snapshot.pods, current, 1)
            ratio = snapshot.requests_waiting / replicas / self.target_waiting
            if abs(ratio - 1) > self.tolerance:
                recommendation = min(math.ceil(current * ratio), max(2 * current, current + 4))
        recommendation = min(max(recommendation, self.min_replicas), self.max_replicas)
        self.history = [(t, r) for t, r in self.history if now - t < self.stabilization_s]
        self.history.append((now, recommendation))
        if recommendation >= current:
            return recommendation
        return min(current, max(r for _, r in self.history))


class Cluster:
    def __init__(
        self,
        model: EngineModel,
        replicas: int,
        max_num_seqs: int,
        gpu_memory_utilization: float,
        routing: str = "random",
        seed: int = 0,
        max_surge: int = 0,
        max_unavailable: int = 1,
        live: bool = False,
    ):
        """``live``: engine-knob changes are made in the running engines (the admin API)
        instead of by a rollout."""
        if max_surge == 0 and max_unavailable == 0:
            raise ValueError("maxSurge and maxUnavailable cannot both be 0")
        self.model = model
        self.max_surge, self.max_unavailable = max_surge, max_unavailable
        self.live = live
        self.live_stall_s = 0.0  # engine time live changes stalled, all engines together
        self.live_busy_until = 0.0  # the engine being changed live answers then
        self.desired = {
            REPLICAS: replicas,
            MAX_NUM_SEQS: max_num_seqs,
            GPU_MEMORY_UTILIZATION: gpu_memory_utilization,
        }
        # Already running when the trace starts.
        self.replicas = [
            Replica(model, max_num_seqs, gpu_memory_utilization, 0.0) for _ in range(replicas)
        ]
        self.round_robin = itertools.count()
        self.routing = routing
        self.rng = np.random.default_rng(seed + 1)
        self.gpu_seconds = 0.0
        self.preemptions = 0
        self.restarts = 0
        self.oom_kills = 0
        self.dropped = 0  # requests cut off mid-answer by the end of a drain

    @property
    def target(self) -> tuple[int, float]:
        return int(self.desired[MAX_NUM_SEQS]), float(self.desired[GPU_MEMORY_UTILIZATION])

    def active(self) -> list[Replica]:
        return [r for r in self.replicas if not r.draining]

    def route(self, requests: list[Request], now: float) -> None:
        """``random``: each request to any ready replica, as a Service (kube-proxy) spreads
        them and as the product routes without a gateway. ``least-outstanding``: fewest
        requests first, as IPVS "lc" or an inference gateway routes; ties go round-robin."""
        serving = [r for r in self.active() if r.ready(now)] or self.active()
        if not serving or not requests:
            return
        if self.routing == "random":
            for request, index in zip(requests, self.rng.integers(len(serving), size=len(requests))):
                serving[int(index)].waiting.append(request)
            return
        offset = next(self.round_robin)
        serving = serving[offset % len(serving) :] + serving[: offset % len(serving)]
        loads = [len(r.running) + len(r.waiting) for r in serving]
        for request in requests:
            index = loads.index(min(loads))
            serving[index].waiting.append(request)
            loads[index] += 1

    def rollout(self, now: float) -> None:
        if self.live and now >= self.live_busy_until:
            # The tuner posts the change to one engine after the other, each answering once
            # it is in effect (after its graphs are captured, if it needs any): one engine
            # at a time changes, none restarts.
            behind = [r for r in self.active() if r.ready(now) and r.pending is None
                      and r.settings != self.target]  # fmt: skip
            if behind:
                answer_s, stall_s = behind[0].retune(*self.target, now)
                self.live_stall_s += stall_s
                self.live_busy_until = now + answer_s
        self._roll_out(now)

    def _roll_out(self, now: float) -> None:
        """The Deployment controller with spec.rollout's RollingUpdate (the product's
        default: maxSurge 0, maxUnavailable 1): scale to ``desired`` replicas, and replace
        replicas with other settings while at most ``desired + maxSurge`` run and at least
        ``desired - maxUnavailable`` are ready. A surge pod starts (and costs its GPU)
        before an old one stops; a stopped one drains (``_drain``)."""
        desired = int(self.desired[REPLICAS])
        active = self.active()
        old = [r for r in active if not self._current(r)]
        most = desired + (self.max_surge if old else 0)
        by_preference = sorted(active, key=lambda r: (self._current(r), r.ready(now)))
        for replica in by_preference[: max(0, len(active) - most)]:
            self._drain(replica, now)
        self._scale_up_new(desired, now)
        # Old replicas stop as far as the ready ones stay at desired - maxUnavailable, and
        # new ones still starting count as unavailable (the controller's maxScaledDown);
        # those not ready go first.
        active = self.active()
        old = sorted((r for r in active if not self._current(r)), key=lambda r: r.ready(now))
        starting_new = sum(not r.ready(now) for r in active if self._current(r))
        budget = len(active) - (desired - self.max_unavailable) - starting_new
        ready_budget = sum(r.ready(now) for r in active) - (desired - self.max_unavailable)
        for replica in old[: max(0, budget)]:
            if replica.ready(now):
                if ready_budget <= 0:
                    break
                ready_budget -= 1
            self._drain(replica, now)
        self._scale_up_new(desired, now)
        self.replicas = self.active() + [r for r in self.replicas if r.draining]

    def _scale_up_new(self, desired: int, now: float) -> None:
        """New replicas up to ``desired`` of them, within ``desired + maxSurge`` in all
        while old ones run."""
        active = self.active()
        new = [r for r in active if self._current(r)]
        most = desired + (self.max_surge if len(new) < len(active) else 0)
        count = max(0, min(most - len(active), desired - len(new)))
        self.replicas += [self._new_replica(now) for _ in range(count)]

    def _current(self, replica: Replica) -> bool:
        """Runs the Deployment's settings: with live changes every replica does (it is
        changed in place, ``rollout``), else those started with them."""
        return self.live or replica.settings == self.target

    def _new_replica(self, now: float) -> Replica:
        return Replica(self.model, *self.target, now + self.model.startup_s)

    def _drain(self, replica: Replica, now: float) -> None:
        """A deleted pod leaves the Service at once and serves what it holds for the
        preStop sleep and the drain (spec.termination's defaults); the rest is aborted."""
        replica.draining = True
        replica.drain_deadline = now + PRE_STOP_S + DRAIN_S

    def rollout_complete(self, now: float) -> bool:
        active = self.active()
        return (
            len(active) == self.desired[REPLICAS]
            and all(r.ready(now) and r.settings == self.target for r in active)
            and not any(r.draining for r in self.replicas)
        )

    def tick(self, now: float, dt: float) -> None:
        for replica in self.replicas:
            self.gpu_seconds += dt
            if replica.ready(now):
                replica.step(now, dt)
                if replica.oom_due():
                    self._oom_kill(replica, now)
        for replica in [r for r in self.replicas if r.draining]:
            if not replica.running and not replica.waiting:
                self.replicas.remove(replica)
            elif now >= replica.drain_deadline:
                held = replica.evict_all()
                replica.stats.aborted += sum(not r.started for r in held)
                self.dropped += sum(r.started for r in held)

    def _oom_kill(self, replica: Replica, now: float) -> None:
        self.oom_kills += 1
        self.restarts += 1
        evicted = replica.evict_all()
        replica.ready_at, replica.busy_s = now + self.model.startup_s, 0.0
        self.route(evicted, now)

    def snapshot(self, window_s: float, ttfts: list[float]) -> Snapshot | None:
        stats = [r.take_stats() for r in self.replicas]
        self.preemptions += sum(s.preemptions for s in stats)
        reporting = [s for s in stats if s.seconds > 0]
        if not reporting:
            return None
        seconds = window_s
        itl_weight = sum(s.itl_weight for s in reporting)
        snapshot = Snapshot(
            window_s=window_s,
            pods=len(reporting),
            kv_cache_usage=float(np.mean([s.kv_usage_s / s.seconds for s in reporting])),
            requests_waiting=sum(s.waiting_s / s.seconds for s in reporting),
            requests_running=sum(s.running_s / s.seconds for s in reporting),
            preemptions_per_s=sum(s.preemptions for s in reporting) / seconds,
            ttft_p95_s=_p95([t for s in reporting for t in s.ttfts]),
            itl_p95_s=(sum(s.itl_s for s in reporting) / itl_weight) if itl_weight else None,
            generation_tokens_per_s=sum(s.generated for s in reporting) / seconds,
            requests_per_s=sum(s.finished for s in reporting) / seconds,
            restarts=float(self.restarts),
            oom_kills=float(self.oom_kills),
            aborted_per_s=sum(s.aborted for s in reporting) / seconds,
            prompt_tokens_per_s=sum(s.prompt_tokens for s in reporting) / seconds,
            queue_growth_per_s=sum(s.waiting_at_end - s.waiting_at_start for s in reporting)
            / seconds,
        )
        # What users saw: a request given up on counts as a first token at the timeout.
        ttfts.extend(t for s in reporting for t in s.ttfts)
        ttfts.extend(CLIENT_TIMEOUT_S for s in reporting for _ in range(s.aborted))
        self.restarts = self.oom_kills = 0
        return snapshot


def simulate(
    trace: Trace,
    start: dict[str, float],
    *,
    limits: Limits | None = None,
    interval_s: float = 30.0,
    ttft_target_s: float | None = None,
    config: PolicyConfig | None = None,
    seed: int = 0,
    give_up_misses: int | None = None,
    autoscaler: QueueAutoscaler | None = None,
    routing: str = "random",
    max_num_batched_tokens: int | None = None,
    max_surge: int = 0,
    max_unavailable: int = 1,
    live: bool = False,
) -> Result:
    """Plays ``trace``; with ``limits`` the tuner (Auto) moves the knobs, with
    ``autoscaler`` a queue-driven autoscaler moves replicas, with neither the configuration
    stays as ``start`` says. ``give_up_misses`` ends a run early once that many SLO windows
    are missed (a static sweep needs no more); ``max_num_batched_tokens`` is the engines'
    step budget when the spec sets one (else the calibration bench's); ``max_surge`` and
    ``max_unavailable`` are spec.rollout's (the product's default: 0 and 1); ``live``:
    engine-knob changes are made in the running engines (``Cluster``)."""
    rng = np.random.default_rng(seed)
    model = engine_model(trace.model)
    if max_num_batched_tokens is not None:
        model = dataclasses.replace(model, max_num_batched_tokens=max_num_batched_tokens)
    ttft_target_s = trace.ttft_target_s if ttft_target_s is None else ttft_target_s
    cluster = Cluster(
        model,
        int(start[REPLICAS]), int(start[MAX_NUM_SEQS]), start[GPU_MEMORY_UTILIZATION],
        routing=routing, seed=seed, max_surge=max_surge, max_unavailable=max_unavailable,
        live=live,
    )  # fmt: skip
    timeline, state, rollouts = Timeline(ttft_target_s=ttft_target_s), None, 0
    live_changes = 0
    window_ttfts: list[float] = []
    slo_met = slo_windows = 0
    steps_per_interval = round(interval_s / TICK_S)
    intervals_per_slo_window = round(SLO_WINDOW_S / interval_s)
    for step in range(round(trace.duration_s / TICK_S)):
        now = step * TICK_S
        arrivals = [Request(*arrival) for arrival in trace.arrivals(now, TICK_S, rng)]
        cluster.route(arrivals, now)
        cluster.rollout(now)
        cluster.tick(now, TICK_S)
        if (step + 1) % steps_per_interval:
            continue
        now += TICK_S
        snapshot = cluster.snapshot(interval_s, window_ttfts)
        if limits is not None:
            decision, state = decide(
                snapshot, dict(cluster.desired), limits, state, now=now, mode="Auto",
                rollout_complete=cluster.rollout_complete(now), config=config or PolicyConfig(),
            )  # fmt: skip
            if decision.action != "hold" or decision.verdict:
                timeline.decisions.append({"time": now, **decision.as_dict()})
            if decision.action in ("change", "revert"):
                cluster.desired[str(decision.knob)] = float(decision.new or 0)
                live_changes += live and decision.knob != REPLICAS
                rollouts += not (live and decision.knob != REPLICAS)
        elif autoscaler is not None:
            current = int(cluster.desired[REPLICAS])
            wanted = autoscaler.desired(current, snapshot, now)
            if wanted != current:
                timeline.decisions.append(
                    {"time": now, "action": "change", "knob": REPLICAS, "old": current,
                     "new": wanted, "reason": "waiting requests per replica vs target"}
                )  # fmt: skip
                cluster.desired[REPLICAS] = wanted
                rollouts += 1
        _record(timeline, cluster, snapshot, trace, now)
        if len(timeline.time) % intervals_per_slo_window == 0:
            slo_windows += 1
            p95 = _p95(window_ttfts)
            slo_met += p95 is None or p95 <= ttft_target_s
            window_ttfts = []
            if give_up_misses is not None and slo_windows - slo_met >= give_up_misses:
                break
    return Result(
        cluster.gpu_seconds / 3600, slo_met, slo_windows, timeline, cluster.preemptions, rollouts,
        cluster.dropped, live_changes, cluster.live_stall_s,
    )


def _record(
    timeline: Timeline, cluster: Cluster, snapshot: Snapshot | None, trace: Trace, now: float
) -> None:
    timeline.time.append(now)
    timeline.replicas.append(len(cluster.replicas))
    timeline.max_num_seqs.append(int(cluster.desired[MAX_NUM_SEQS]))
    timeline.gpu_memory_utilization.append(float(cluster.desired[GPU_MEMORY_UTILIZATION]))
    ttft = snapshot.ttft_p95_s if snapshot is not None else None
    timeline.ttft_p95_s.append(float("nan") if ttft is None else ttft)
    timeline.rate.append(trace.rate(now - 1e-9))


def _p95(values: list[float]) -> float | None:
    return float(np.percentile(values, 95)) if values else None
