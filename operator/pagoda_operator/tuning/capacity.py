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
    max_num_seqs: float | None = None,
) -> Capacity | None:
    """An engine's saturated rate: what it served while requests queued, at the
    ``maxNumSeqs`` the engines ran. It is forgotten when the prompts change a lot (see
    ``usable``) and when it grows old."""
    pods = max(snapshot.pods, 1)
    if saturated(snapshot, queued_before, limits, config) and snapshot.requests_per_s > 0:
        # A queue on some engines but not all still counts here, so one window tends to
        # understate the rate: keep the best one seen for the same kind of requests at the
        # same maxNumSeqs. One measured at another maxNumSeqs is replaced: this one is
        # measured, the other's rate here only estimated (``at_max_num_seqs``).
        rate = snapshot.requests_per_s / pods
        if capacity is not None and capacity.max_num_seqs in (None, max_num_seqs):
            rate = max(rate, usable(capacity, snapshot, config, max_num_seqs) or 0.0)
        return Capacity(
            rate, prompt_length(snapshot), now, max_num_seqs,
            snapshot.requests_running / pods, snapshot.itl_p95_s, snapshot.kv_cache_usage,
        )  # fmt: skip
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


def usable(
    capacity: Capacity | None,
    snapshot: Snapshot,
    config: PolicyConfig,
    max_num_seqs: float | None = None,
) -> float | None:
    """The saturated rate at the ``maxNumSeqs`` the engines run now (``at_max_num_seqs``),
    unless the prompts changed so much since it was measured that it no longer says what
    an engine can do (a shift to long contexts, say)."""
    if not capacity:
        return None
    then, now = capacity.prompt_tokens_per_request or 0.0, prompt_length(snapshot)
    if then > 0 and now > 0 and max(then, now) / min(then, now) > config.prompt_shift_ratio:
        return None
    return at_max_num_seqs(capacity, snapshot, config, max_num_seqs)


def at_max_num_seqs(
    capacity: Capacity, snapshot: Snapshot, config: PolicyConfig, max_num_seqs: float | None
) -> float:
    """The saturated rate measured, carried over to a ``maxNumSeqs`` changed since, until
    a saturated window at the new value measures it (``updated``).

    It moves only where the batch slots were the limit when it was measured (every engine
    ran ``busy_fraction`` of its slots or more): an engine that saturated on compute, the
    cache or its prompts' prefill with slots to spare serves the same with more of them.
    Then, for n sequences running, an engine finishes requests at a rate proportional to
    n / step(n), a decode step growing with the batch: step(n) = a + b n (the weights read
    once a step, then each sequence's own work and KV reads). The engines' ITL p95 gives
    two points of it, the saturated window's and this one's, where their batches differ by
    ``step_fit_spread`` or more; a decode-heavy batch of long contexts pays nearly all of
    its step per sequence, and gains little from more slots (the tenants trace: +14 %
    estimated, +8 % measured, for twice the slots).

    - a raise: by that model, with the batch as full as it was, at most in proportion to
      the slots and never below the rate measured (more slots never serve less while the
      cache holds them). Without a fit (no second point, or one that says the step shrinks
      with the batch), or when the cache at the KV each sequence held then would pass
      ``kv_headroom`` with the new batch (it, not the slots, is then the limit), the rate
      measured, which a raise does not lower;
    - a cut: in proportion to the slots, the least it can be (each step gets shorter too).
    """
    rate, then = capacity.requests_per_pod, capacity.max_num_seqs
    running = capacity.running_per_pod
    if max_num_seqs is None or then is None or running is None or max_num_seqs == then:
        return rate
    if running < config.busy_fraction * then:
        return rate
    ratio = max_num_seqs / then
    if ratio < 1:
        return rate * ratio
    kv = capacity.kv_cache_usage
    if kv is None or kv * ratio > config.kv_headroom:
        return rate
    step = _step_fit(capacity, snapshot, config)
    if step is None:
        return rate
    a, b = step
    grown = running * ratio
    if a + b * grown <= 0 or a + b * running <= 0:
        return rate
    factor = (grown / (a + b * grown)) / (running / (a + b * running))
    return rate * min(max(factor, 1.0), ratio)


def _step_fit(
    capacity: Capacity, snapshot: Snapshot, config: PolicyConfig
) -> tuple[float, float] | None:
    """The decode step as a + b n from the saturated window's ITL p95 and this window's,
    or None where they do not give one: an ITL missing, batches too close, or a step
    that shrinks as the batch grows."""
    n1, step1 = capacity.running_per_pod, capacity.itl_s
    n2, step2 = snapshot.requests_running / max(snapshot.pods, 1), snapshot.itl_p95_s
    if n1 is None or step1 is None or step2 is None or n1 <= 0:
        return None
    if abs(n1 - n2) < config.step_fit_spread * n1:
        return None
    b = (step1 - step2) / (n1 - n2)
    if b < 0:
        return None
    return step1 - b * n1, b


def prompt_length(snapshot: Snapshot) -> float:
    if snapshot.requests_per_s <= 0:
        return 0.0
    return snapshot.prompt_tokens_per_s / snapshot.requests_per_s


def demand_per_s(snapshot: Snapshot) -> float:
    """Requests/s arriving: served, given up on, and added to the queue."""
    return max(0.0, snapshot.requests_per_s + snapshot.aborted_per_s + snapshot.queue_growth_per_s)
