"""The hysteresis: which conditions held in a window, counted over consecutive windows."""

from __future__ import annotations

from pagoda_operator.tuning.capacity import demand_per_s
from pagoda_operator.tuning.model import Limits, PolicyConfig, Snapshot
from pagoda_operator.tuning.state import Streaks


def projected_kv(snapshot: Snapshot, before: float | None) -> float:
    """The KV cache usage one window ahead if it keeps rising as it did in this one."""
    if before is None:
        return snapshot.kv_cache_usage
    return snapshot.kv_cache_usage + max(0.0, snapshot.kv_cache_usage - before)


def updated_streaks(
    streaks: Streaks,
    snapshot: Snapshot,
    limits: Limits,
    capacity: float | None,
    kv_next: float,
    config: PolicyConfig,
) -> Streaks:
    """Consecutive windows for which each condition held; a window without it resets it."""
    pods = max(snapshot.pods, 1)
    waiting_per_pod = snapshot.requests_waiting / pods
    ttft = snapshot.ttft_p95_s
    preempting = snapshot.preemptions_per_s / pods >= config.preemptions_per_pod_s
    queued = waiting_per_pod >= config.queue_per_pod
    held = {
        "overload": queued or (ttft is not None and ttft > limits.ttft_target_s),
        "idle": (
            waiting_per_pod <= config.idle_queue_per_pod
            and (ttft is None or ttft < config.idle_ttft_fraction * limits.ttft_target_s)
            and snapshot.preemptions_per_s == 0
        ),
        "preempting": preempting,
        "kv_bound": snapshot.kv_cache_usage >= config.kv_bound
        and (waiting_per_pod >= config.queue_per_pod or preempting),
        # Filling without preemptions yet (with them, the batch is what outgrows the cache).
        "kv_busy": not preempting
        and (snapshot.kv_cache_usage >= config.kv_busy or filling_fast(snapshot, kv_next, config)),
        # Nothing waiting, nothing preempted, TTFT well within target: a window in which
        # engines can restart one by one for a better balance of batch and cache (see
        # rules.max_num_seqs.calm_raise).
        "calm": (
            not queued
            and snapshot.preemptions_per_s == 0  # any: a raise must not undo a cut for them
            and snapshot.requests_running > 0
            and (ttft is None or ttft <= config.idle_ttft_fraction * limits.ttft_target_s)
        ),
        "near_target": ttft is not None and ttft > config.near_ttft_fraction * limits.ttft_target_s,
        "busy": capacity is not None
        and demand_per_s(snapshot) / pods >= config.busy_utilization * capacity,
        "queued": queued,
    }
    return Streaks(**{
        name: getattr(streaks, name) + 1 if condition else 0 for name, condition in held.items()
    })  # fmt: skip


def filling_fast(snapshot: Snapshot, kv_next: float, config: PolicyConfig) -> bool:
    """Past kv_headroom and, at this window's pace, past kv_bound by the next: no time for
    hysteresis (a cache that fills admits no one, or preempts)."""
    usage = snapshot.kv_cache_usage
    return usage >= config.kv_headroom and kv_next >= config.kv_bound and kv_next > usage
