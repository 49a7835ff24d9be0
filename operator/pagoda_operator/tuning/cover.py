"""Covered rollouts: engines added before an engine-knob change rolls out, and given back
once it is judged.

A change of maxNumSeqs or gpuMemoryUtilization restarts every engine, ``maxUnavailable``
at a time. In a calm window whose engines left serving are not known to carry the load,
the change goes in three steps, one window each at least:

1. ``add_cover``: the engines the rollout takes down are added (phase ``adding``);
2. ``covered``: once they are Ready, the change itself (phase ``rolling``);
3. ``give_back``: once the change is judged, the engines go back, unless the replica
   rules want them by then.
"""

from __future__ import annotations

from pagoda_operator.tuning.allowed import allowed as allowed_proposal
from pagoda_operator.tuning.capacity import demand_per_s
from pagoda_operator.tuning.context import Context
from pagoda_operator.tuning.judge import watch_pending
from pagoda_operator.tuning.model import (
    REPLICAS,
    Decision,
    Limits,
    PolicyConfig,
    Proposal,
    Snapshot,
    fmt,
)
from pagoda_operator.tuning.state import Cover, Pending


def add_cover(proposal: Proposal, ctx: Context, verdict: str | None) -> Decision:
    """The first step of a covered engine-knob change: the engines its rollout takes down
    are added now; the change itself waits for them (``covered``). Not a tuning move of
    replicas (no cooldown, no dwell): the engines go back once the change is judged."""
    replicas, snapshot = ctx.replicas, ctx.snapshot
    change = f"{proposal.knob} {fmt(ctx.settings[proposal.knob])} -> {fmt(proposal.new)}"
    ctx.state.cover = Cover(
        phase="adding",
        knob=proposal.knob,
        from_=ctx.settings[proposal.knob],
        to=proposal.new,
        reason=proposal.reason,
        engines=proposal.cover,
        replicas=replicas + proposal.cover,
        # The window before the cover, every engine serving all of it: the change is
        # judged per engine against it.
        baseline=snapshot.summary(),
    )
    ctx.state.pending = Pending(
        REPLICAS, replicas, replicas + proposal.cover, ctx.now, snapshot.summary(), cover=True
    )
    reason = (
        f"{proposal.cover} engines added to cover the rollout of {change}, which takes "
        f"{proposal.cover} down at a time; the change follows once they are Ready: "
        f"{proposal.reason}"
    )
    return Decision("change", reason, REPLICAS, replicas, replicas + proposal.cover, verdict)


def covered(ctx: Context) -> Decision:
    """While the engines added to cover a change start: hold (or revert them when they do
    not come up by the deadline); once they are Ready, the change, unless it is no longer
    allowed or the load has risen so that the replica rules want the engines (they stay)."""
    state = ctx.state
    cover = state.cover
    assert cover is not None
    if not ctx.rollout_complete:
        outcome = watch_pending(
            ctx.snapshot, ctx.limits, state, ctx.now, ctx.rollout_complete, ctx.config
        )
        assert isinstance(outcome, Decision)  # a rollout under way is never judged
        if outcome.action == "revert":
            state.cover = None
        return outcome
    state.pending = None
    state.cover = None
    change = f"{cover.knob} {fmt(cover.from_)} -> {fmt(cover.to)}"
    ready = f"{cover.engines} engines added to cover the rollout of {change} Ready"
    if state.streaks.overload or state.streaks.near_target:
        return Decision(
            "hold",
            f"the {cover.engines} engines added to cover {change} are Ready, but the load "
            f"rose meanwhile: they stay, and {cover.knob} stays until the next calm",
            verdict=f"{ready}; they stay: the load rose meanwhile",
        )
    allowed = allowed_proposal(Proposal(cover.knob, cover.to, cover.reason), ctx)
    if isinstance(allowed, str) or ctx.settings[cover.knob] != cover.from_:
        why = allowed if isinstance(allowed, str) else f"{cover.knob} changed meanwhile"
        return Decision("hold", f"{change} not made: {why}", verdict=f"{ready}; they stay")
    state.cover = Cover(**{**vars(cover), "phase": "rolling"})
    state.pending = Pending(cover.knob, cover.from_, allowed.new, ctx.now, cover.baseline)
    state.record_move(cover.knob, cover.from_, allowed.new, ctx.now)
    return Decision(
        "change",
        f"the {cover.engines} engines added to cover its rollout are Ready: {cover.reason}",
        cover.knob,
        cover.from_,
        allowed.new,
        verdict=ready,
    )


def give_back(ctx: Context, verdict: str | None) -> Decision | None:
    """Once a covered change has been judged, its engines go back, unless the replica rules
    want them by then (the engines left would run near their limits: TTFT near the target,
    a queue, busy slots or cache, or demand near the saturated rate measured) or the
    replicas moved meanwhile. None when they stay: the window goes on to the rules."""
    state, snapshot, config = ctx.state, ctx.snapshot, ctx.config
    cover, state.cover = state.cover, None
    assert cover is not None
    if ctx.replicas != cover.replicas:
        return None
    streaks = state.streaks
    if any((streaks.overload, streaks.near_target, streaks.busy, streaks.kv_busy,
            streaks.queued)):  # fmt: skip
        return None
    pods_after = snapshot.pods - cover.engines
    if pods_after < 1:
        return None
    spread = snapshot.pods / pods_after
    if (
        snapshot.requests_running / snapshot.pods * spread > config.busy_fraction * ctx.seqs
        or snapshot.kv_cache_usage * spread > config.kv_headroom
    ):
        return None
    if ctx.capacity is not None and demand_per_s(snapshot) > (
        pods_after * ctx.capacity * config.scale_up_utilization
    ):
        return None
    replicas = ctx.replicas
    state.pending = Pending(
        REPLICAS, replicas, replicas - cover.engines, ctx.now, snapshot.summary()
    )
    change = f"{cover.knob} {fmt(cover.from_)} -> {fmt(cover.to)}"
    return Decision(
        "change",
        f"giving back the {cover.engines} engines added to cover the rollout of {change}, "
        f"now judged; {pods_after} engines hold the load",
        REPLICAS,
        replicas,
        replicas - cover.engines,
        verdict,
    )


def cover_engines(replicas: float, limits: Limits) -> int:
    """Engines to add, and have Ready, before a calm engine-knob change rolls out, when the
    engines left serving through it are not known to carry the load: as many as its
    rollout takes down at once (maxUnavailable), as far as replicas may grow. Then
    the Deployment, at its new size with maxUnavailable k, keeps the engines that served
    before ready throughout (it stops an old engine only while that many stay ready): a
    surge the user's rollout does not have, lent for the rollout and given back once the
    change is judged. Without a measured saturated rate, that is the only way to know the
    engines left serving carry the load. None for Recreate: it stops every engine, however
    many there are; none when replicas are not the tuner's to move."""
    unavailable = limits.rollout_unavailable
    if unavailable is None or unavailable == 0 or REPLICAS not in limits.bounds:
        return 0
    room = int(limits.bounds[REPLICAS][1] - replicas)
    return max(0, min(unavailable, room))


def rollout_carried_calm(
    snapshot: Snapshot,
    seqs: float,
    limits: Limits,
    capacity: float | None,
    cover: int,
    config: PolicyConfig,
) -> bool:
    """Whether the engines left serving while a knob change rolls out (``maxUnavailable``
    fewer, ``cover`` added before it) hold what all of them hold now with room: their
    slots under ``busy_fraction``, their cache under ``kv_headroom``, and the demand within
    ``scale_up_utilization`` of the saturated rate measured. A rollout that surges with
    maxUnavailable 0 loses none, and neither does one whose engines are covered."""
    pods = max(snapshot.pods, 1)
    down = pods if limits.rollout_unavailable is None else min(limits.rollout_unavailable, pods)
    down = max(0, down - cover)
    if down == 0:
        return True
    left = pods - down
    if left <= 0:
        return False
    spread = pods / left
    slots_ok = snapshot.requests_running / pods * spread <= config.busy_fraction * seqs
    cache_ok = snapshot.kv_cache_usage * spread <= config.kv_headroom
    # Slots and cache say nothing of compute (an engine's rate saturates long before its
    # slots fill): without a saturated rate measured, one engine fewer is a guess.
    rate_ok = capacity is not None and demand_per_s(snapshot) <= (
        left * capacity * config.scale_up_utilization
    )
    return slots_ok and cache_ok and rate_ok
