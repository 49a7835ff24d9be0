"""The rules for replicas: engines are added for the demand measured, early where the
cache or TTFT say it is close, and one is removed only where a saturated rate measured
says the others carry the load."""

from __future__ import annotations

import math

from pagoda_operator.tuning.capacity import demand_per_s, severe
from pagoda_operator.tuning.context import Context
from pagoda_operator.tuning.model import REPLICAS, Proposal


def for_overload(ctx: Context, why: str) -> list[Proposal]:
    """Enough engines for the demand. Clients giving up or TTFT far over target: the
    demand measured is added at once, up to the bound, not at most
    ``max_scale_up_factor`` times as many."""
    ceiling = None
    if severe(ctx.snapshot, ctx.limits, ctx.config):
        ceiling = ctx.limits.bounds.get(REPLICAS, (ctx.replicas, ctx.replicas))[1]
    return scale_up(ctx, why, ceiling)


def for_busy_engines(ctx: Context) -> list[Proposal]:
    """Demand near the saturated rate measured: engines before the queue forms."""
    load = demand_per_s(ctx.snapshot) / ctx.pods / (ctx.capacity or 1.0)
    return scale_up(ctx, f"demand at {load:.0%} of the engines' saturated rate")


def for_filling_cache(ctx: Context) -> list[Proposal]:
    """Sequences that live long fill the cache before compute or slots run out: when it
    is full, requests queue for it (or are preempted). Engines are added before that,
    enough to bring the cache back to kv_headroom."""
    snapshot, config, replicas = ctx.snapshot, ctx.config, ctx.replicas
    wanted = math.ceil(snapshot.pods * snapshot.kv_cache_usage / config.kv_headroom)
    new = min(max(wanted, replicas + 1), config.max_scale_up_factor * replicas)
    return [Proposal(
        REPLICAS, new,
        f"KV cache {snapshot.kv_cache_usage:.0%} full (next window at this pace: "
        f"{min(ctx.kv_next, 1.0):.0%}) for {ctx.state.streaks.kv_busy} windows: "
        f"{new:g} engines hold it at {snapshot.kv_cache_usage * snapshot.pods / new:.0%}",
    )]  # fmt: skip


def near_target(ctx: Context) -> list[Proposal]:
    """TTFT close to its target, sustained: one engine more."""
    ttft, target = ctx.snapshot.ttft_p95_s or 0.0, ctx.limits.ttft_target_s
    return [Proposal(
        REPLICAS, ctx.replicas + 1,
        f"TTFT p95 {ttft:.3g}s at {ttft / target:.0%} of the "
        f"{target:g}s target for {ctx.state.streaks.near_target} windows",
    )]  # fmt: skip


def when_idle(ctx: Context) -> list[Proposal]:
    """One replica less, when the others would still run well below the saturated rate
    measured for these requests. Without one there is no scale-down: batch slots say
    nothing of an engine's compute (it saturates long before they fill), so removing a
    replica by them is a probe that breaks the SLO when it is wrong."""
    snapshot, config, capacity = ctx.snapshot, ctx.config, ctx.capacity
    if capacity is None:
        return []
    pods_after = snapshot.pods - 1
    load_after = demand_per_s(snapshot) / pods_after / capacity
    kv_after = snapshot.kv_cache_usage * snapshot.pods / pods_after
    if load_after > config.scale_down_utilization or kv_after > config.kv_headroom:
        return []
    why = (f"idle for {snapshot.window_s:g}s windows: {pods_after} engines would run at "
           f"{load_after:.0%} of their saturated rate")  # fmt: skip
    return [Proposal(REPLICAS, ctx.replicas - 1, why)]


def scale_up(ctx: Context, why: str, ceiling: float | None = None) -> list[Proposal]:
    """Enough replicas for the demand at the rate each engine serves now, saturated.

    Demand is what was served, what clients gave up on and what the queue grew by; the
    queue's length itself is not demand (it says how long requests wait, not how many
    arrive), so a long backlog does not inflate the count. At most
    ``max_scale_up_factor`` times as many engines, so one noisy window cannot ask for
    many, unless a ``ceiling`` is given (clients giving up, TTFT far over target): each
    window short is then one more the SLO misses (a burst that tripled the rate from 2
    engines took two looks at the cap: 4 missed windows where 3 remain), and the queue to
    drain counts too.
    """
    snapshot, config, replicas = ctx.snapshot, ctx.config, ctx.replicas
    demand = demand_per_s(snapshot)
    # In a severe overload, also the queue, drained within a window: the requests queued on
    # an engine stay there (a Service does not move them), so the engines there need a
    # smaller share of what arrives to get through them while clients still wait.
    backlog = snapshot.requests_waiting / snapshot.window_s if ceiling is not None else 0.0
    per_pod = ctx.capacity or snapshot.requests_per_s / ctx.pods
    most = (
        max(replicas, ceiling) if ceiling is not None else (config.max_scale_up_factor * replicas)
    )
    if per_pod <= 0:  # nothing served: no rate to size by, so one step at a time
        wanted = replicas + 1
    else:
        wanted = min(most, (demand + backlog) / (per_pod * config.scale_up_utilization))
    if math.ceil(wanted) <= replicas and snapshot.queue_growth_per_s <= 0:
        return []  # the engines there can serve the demand: the backlog is draining
    new = min(max(math.ceil(wanted), replicas + 1), most)
    return [Proposal(
        REPLICAS,
        new,
        f"{why}; demand {demand:.3g} req/s"
        + (f" and {snapshot.requests_waiting:.3g} queued" if backlog else "")
        + f", {per_pod:.3g} req/s served per engine",
    )]  # fmt: skip
