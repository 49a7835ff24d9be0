"""The rules for maxNumSeqs: the sequences an engine batches. Where the engines take it live
(``Limits.engine_knobs_live``) a change costs a step; otherwise every engine restarts to take
a new value, so a raise is made where the engines left serving through the rollout carry
the load (with engines added first to cover it where they would not: ``cover``)."""

from __future__ import annotations

import math

from pagoda_operator.tuning.capacity import demand_per_s, severe
from pagoda_operator.tuning.context import Context
from pagoda_operator.tuning.cover import cover_engines, rollout_carried_calm
from pagoda_operator.tuning.model import (
    MAX_NUM_SEQS,
    REPLICAS,
    PolicyConfig,
    Proposal,
    Snapshot,
    fmt,
)


def after_oom(ctx: Context, why: str) -> list[Proposal]:
    """OOM kills in the window: half the batch."""
    return [Proposal(MAX_NUM_SEQS, halved(ctx.seqs, ctx.config), why)]


def under_preemptions(ctx: Context) -> list[Proposal]:
    """Sustained preemptions (or a storm of them): the batch outgrows the KV cache."""
    snapshot = ctx.snapshot
    return [Proposal(
        MAX_NUM_SEQS,
        fitted_to_cache(snapshot, ctx.seqs, ctx.config),
        f"{snapshot.preemptions_per_s:.3g} preemptions/s for "
        f"{ctx.state.streaks.preempting} windows: the batch outgrows the KV cache",
    )]  # fmt: skip


def overload_raise(ctx: Context, why: str) -> list[Proposal]:
    """Every slot busy and requests waiting, whatever the queue's length: a bigger batch
    serves more on the same GPU (a sequence adds ~11.5 us to a decode step of ~4 ms; a
    replica costs a GPU), so it comes first, as far as the cache measured says it fits.

    But every engine restarts to take it: with the default rollout (maxUnavailable 1) one
    engine fewer serves while it rolls out, which deepens an overload that more engines
    would relieve. So it comes first only when the engines left serving carry the demand
    meanwhile, or replicas cannot grow. A rollout that surges with maxUnavailable 0 takes
    none away, but it still holds every other change until it has rolled out and been
    judged (minutes): in a severe overload each of those windows misses the SLO, and
    engines, which start at once, come first."""
    snapshot, limits, config, seqs = ctx.snapshot, ctx.limits, ctx.config, ctx.seqs
    pods = ctx.pods
    running = snapshot.requests_running / pods
    slots_full = running >= config.busy_fraction * seqs
    waiting = snapshot.requests_waiting > 0
    can_add = REPLICAS in limits.bounds and ctx.replicas < limits.bounds[REPLICAS][1]
    per_pod = ctx.capacity or snapshot.requests_per_s / pods
    down = pods if limits.rollout_unavailable is None else min(limits.rollout_unavailable, pods)
    if limits.engine_knobs_live:
        down = 0  # taken live: no engine leaves service (a severe overload still adds engines)
    carried = (
        (down == 0 and not severe(snapshot, limits, config))
        or (pods - down) * per_pod >= demand_per_s(snapshot)
        or not can_add
    )
    if not (slots_full and waiting and carried and snapshot.preemptions_per_s == 0):
        return []
    if not _itl_well_within(ctx):
        return []
    new = batch_that_fits(snapshot, seqs, config)
    if new < config.min_max_num_seqs_raise * seqs:
        return []
    return [Proposal(
        MAX_NUM_SEQS,
        new,
        f"{why}; every batch slot busy with KV cache at "
        f"{snapshot.kv_cache_usage:.0%}: {new} sequences fill "
        f"{snapshot.kv_cache_usage * new / max(running, 1e-9):.0%} of it",
    )]  # fmt: skip


def calm_raise(ctx: Context) -> list[Proposal]:
    """In a calm window, a bigger batch when the KV cache holds ``min_max_num_seqs_raise``
    times ``maxNumSeqs`` or more at ``kv_headroom`` (at the KV each running sequence holds
    now): the slots, not the cache, will be the limit when the load rises, and a bigger
    batch serves more on the same GPU then (a sequence adds ~11.5 us to a decode step of
    ~4 ms). Made ahead of the demand because every engine restarts to take it: in the
    overload that would show the slots full, the rollout costs serving capacity (with
    maxUnavailable 1) or holds every other change until it has rolled out and been judged.
    Only while the engines left serving through the rollout carry the load with room (with
    the engines it takes down added first where replicas can grow: ``cover_engines``),
    and the ITL is well within its target."""
    snapshot, limits, config, seqs = ctx.snapshot, ctx.limits, ctx.config, ctx.seqs
    running = snapshot.requests_running / ctx.pods
    high = limits.bounds.get(MAX_NUM_SEQS, (seqs, seqs))[1]
    if running <= 0 or snapshot.kv_cache_usage <= 0 or seqs >= high:
        return []
    if not _itl_well_within(ctx):
        return []
    # Engines are lent to the rollout only where those left serving are not known to carry
    # the load (no saturated rate measured, or one too close): a GPU is not spent for nothing.
    # Live engine knobs take no engine out of service: nothing to carry, none to lend.
    cover = 0
    live = limits.engine_knobs_live
    if not live and not rollout_carried_calm(snapshot, seqs, limits, ctx.capacity, 0, config):
        cover = cover_engines(ctx.replicas, limits)
        if not cover or not rollout_carried_calm(snapshot, seqs, limits, ctx.capacity, cover, config):
            return []
    new = batch_that_fits(snapshot, seqs, config)
    if new < config.min_max_num_seqs_raise * seqs:
        return []
    fill = snapshot.kv_cache_usage * new / running
    return [Proposal(
        MAX_NUM_SEQS, new,
        f"calm for {config.windows_up}+ windows with KV cache at "
        f"{snapshot.kv_cache_usage:.0%}: {new} sequences an engine fill {fill:.0%} of it, "
        f"{fmt(seqs)} slots would be the limit when the load rises",
        cover,
    )]  # fmt: skip


def _itl_well_within(ctx: Context) -> bool:
    """ITL p95 under half its target (or no target, or no ITL measured): a bigger batch
    slows every decode step a little, so there must be room for it."""
    target, itl = ctx.limits.itl_target_s, ctx.snapshot.itl_p95_s
    return target is None or itl is None or itl < 0.5 * target


def batch_that_fits(snapshot: Snapshot, seqs: float, config: PolicyConfig) -> int:
    """A bigger batch (at most ``max_num_seqs_factor`` times this one) whose sequences, at
    the KV each running one holds now, fill at most ``kv_headroom`` of the cache; ``seqs``
    when none fit."""
    running = snapshot.requests_running / max(snapshot.pods, 1)
    if running <= 0:
        return int(seqs)
    fits = math.floor(running * config.kv_headroom / max(snapshot.kv_cache_usage, 1e-9))
    return int(max(seqs, min(fits, math.floor(seqs * config.max_num_seqs_factor))))


def fitted_to_cache(snapshot: Snapshot, seqs: float, config: PolicyConfig) -> int:
    """Under preemptions: as many sequences as would fill ``kv_headroom`` of the KV cache
    (the running ones filled ``kv_cache_usage`` of it; the rest is room for them to grow),
    and at least one fewer. A recompute preemption redoes a whole context, so a batch that
    fits serves more than one that thrashes."""
    running = snapshot.requests_running / max(snapshot.pods, 1)
    usage = max(snapshot.kv_cache_usage, 1e-9)
    fits = math.floor(running * config.kv_headroom / usage)
    return max(1, min(int(seqs) - 1, fits))


def halved(value: float, config: PolicyConfig) -> int:
    return max(1, min(int(value) - 1, math.ceil(value / config.max_num_seqs_factor)))
