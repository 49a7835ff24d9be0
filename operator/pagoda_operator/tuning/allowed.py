"""What may be done with a rule's proposal: the bounds, pins, dwell and bans it meets."""

from __future__ import annotations

import dataclasses

from pagoda_operator.tuning.context import Context
from pagoda_operator.tuning.model import (
    GPU_MEMORY_UTILIZATION,
    MAX_NUM_SEQS,
    REPLICAS,
    Proposal,
    direction,
    fmt,
)


def allowed(proposal: Proposal, ctx: Context) -> Proposal | str:
    """The proposal held to the bounds, or why the bounds, a pin, a dwell or an earlier
    revert leave nothing of it."""
    knob, limits = proposal.knob, ctx.limits
    if knob not in limits.bounds:
        return f"{knob} is fixed: {limits.fixed.get(knob, 'not tunable')}"
    low, high = limits.bounds[knob]
    if knob == MAX_NUM_SEQS and limits.max_num_batched_tokens is not None:
        high = min(high, limits.max_num_batched_tokens)
    current = ctx.settings[knob]
    new = min(max(proposal.new, low), high)
    if knob != GPU_MEMORY_UTILIZATION:
        new = int(round(new))
    way = direction(current, new)
    # Clamping may bring a value from outside the bounds back inside, but only in the
    # direction the rule asked for: a scale-up never turns into a scale-down.
    if way == 0 or way != direction(current, proposal.new):
        return f"{knob} {fmt(current)} is at its bound [{fmt(low)}, {fmt(high)}]"
    last = ctx.state.last_move.get(knob)
    dwell = ctx.config.reversal_dwell_cooldowns * limits.cooldown_s
    if last is not None and last.direction == -way and ctx.now - last.time < dwell:
        return f"{knob} moved the other way {ctx.now - last.time:.0f}s ago"
    for rejected in ctx.state.rejected:
        if rejected.knob == knob and rejected.direction == way:
            if (new - rejected.value) * way >= 0:
                return f"{knob} {fmt(rejected.value)} was reverted recently"
    return dataclasses.replace(proposal, new=new)


def urgent(proposal: Proposal, settings: dict[str, float]) -> bool:
    """A change that adds capacity: more replicas, or fewer sequences per engine under
    preemptions (each preemption recomputes a whole context)."""
    lower_seqs = proposal.knob == MAX_NUM_SEQS and proposal.new < settings[MAX_NUM_SEQS]
    more_replicas = proposal.knob == REPLICAS and proposal.new > settings[REPLICAS]
    return lower_seqs or more_replicas
