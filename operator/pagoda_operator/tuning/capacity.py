"""What one engine can serve: the saturated rate measured, and when it no longer holds."""

from __future__ import annotations

from pagoda_operator.tuning.model import Limits, PolicyConfig, Snapshot
from pagoda_operator.tuning.state import Capacity, Pending


def updated(
    capacity: Capacity | None,
    snapshot: Snapshot,
    queued_before: int,
    now: float,
    limits: Limits,
    config: PolicyConfig,
) -> Capacity | None:
    """An engine's saturated rate: what it served while requests queued. It is forgotten
    when the prompts change a lot (see ``usable``) and when it grows old."""
    pods = max(snapshot.pods, 1)
    if saturated(snapshot, queued_before, limits, config) and snapshot.requests_per_s > 0:
        # A queue on some engines but not all still counts here, so one window tends to
        # understate the rate: keep the best one seen for the same kind of requests.
        rate = snapshot.requests_per_s / pods
        rate = max(rate, usable(capacity, snapshot, config) or 0.0)
        return Capacity(rate, prompt_length(snapshot), now)
    if capacity and now - capacity.time > config.capacity_memory_cooldowns * limits.cooldown_s:
        return None
    return capacity


def unchanging(pending: Pending | None, snapshot: Snapshot, now: float) -> bool:
    """No change under watch, or this is the full window after its rollout that judges it."""
    if pending is None:
        return True
    settled = pending.settled_time
    return settled is not None and now - settled >= snapshot.window_s


def saturated(
    snapshot: Snapshot, queued_before: int, limits: Limits, config: PolicyConfig
) -> bool:
    """Whether the engines served all they could in this window: a queue that is not
    shrinking and has lasted ``windows_up`` windows (``queued_before`` counts the ones
    before this), or one with clients giving up or TTFT far over target.

    A queue that a Poisson burst forms at high but sustainable load is there one window
    and gone the next: the rate served then is the demand, not the engines' limit, and
    taking it for the limit has the tuner add replicas the load does not need. While a
    backlog drains, the requests that finish were admitted windows earlier, so the rate
    finished then overstates what an engine sustains (and so does its prompt length)."""
    if snapshot.requests_waiting / max(snapshot.pods, 1) < config.queue_per_pod:
        return False
    if snapshot.queue_growth_per_s < 0:
        return False
    return queued_before + 1 >= config.windows_up or severe(snapshot, limits, config)


def severe(snapshot: Snapshot, limits: Limits, config: PolicyConfig) -> bool:
    """Clients giving up, or TTFT far over target: no noise to filter, one window is enough."""
    return snapshot.aborted_per_s / max(snapshot.pods, 1) >= config.aborts_per_pod_s or (
        snapshot.ttft_p95_s is not None
        and snapshot.ttft_p95_s > config.severe_ttft_factor * limits.ttft_target_s
    )


def usable(capacity: Capacity | None, snapshot: Snapshot, config: PolicyConfig) -> float | None:
    """The saturated rate, unless the prompts changed so much since it was measured that
    it no longer says what an engine can do (a shift to long contexts, say)."""
    if not capacity:
        return None
    then, now = capacity.prompt_tokens_per_request or 0.0, prompt_length(snapshot)
    if then > 0 and now > 0 and max(then, now) / min(then, now) > config.prompt_shift_ratio:
        return None
    return capacity.requests_per_pod


def prompt_length(snapshot: Snapshot) -> float:
    if snapshot.requests_per_s <= 0:
        return 0.0
    return snapshot.prompt_tokens_per_s / snapshot.requests_per_s


def demand_per_s(snapshot: Snapshot) -> float:
    """Requests/s arriving: served, given up on, and added to the queue."""
    return max(0.0, snapshot.requests_per_s + snapshot.aborted_per_s + snapshot.queue_growth_per_s)
