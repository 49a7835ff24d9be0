"""The tuner's decision: one window of metrics in, at most one knob change out.

Pure: the operator (``runner``), the simulator and the tests all call ``decide`` with plain
values and a ``TunerState`` (``state``) that lives in ``status.tuning.state`` between
windows. This module orders a window's steps; the parts live beside it: ``capacity`` (the
saturated rate), ``signals`` (the hysteresis streaks), ``judge`` (the change under watch),
``cover`` (engines lent to an engine-knob rollout), ``rules`` (one module per knob) and
``allowed`` (bounds, pins, dwell and bans).

What keeps it steady:

- hysteresis: a condition must hold for several consecutive windows before it acts, and the
  thresholds that push a knob up and down are far apart, so noise around one cannot trigger
  the other;
- a cooldown after every change, which also waits for the rollout to finish and for one full
  window of metrics after it, so a change is never judged on a replica still loading; once
  the change is judged, changes that add capacity may act inside it (nothing can flap
  then), the rest wait for its end;
- engine knobs that restart every engine move ahead of the load where they can: a bigger
  batch is made in a calm window when the KV cache holds far more sequences than the
  slots allow, so that it is there before a peak fills the slots;
- step limits (maxNumSeqs at most doubles or halves, gpuMemoryUtilization moves 0.02,
  replicas at most double going up and drop by one going down);
- one knob at a time, never outside the user's bounds, never a knob the user pinned;
- a change that made things worse is reverted and its value is not tried again for a while,
  and so is one whose rollout fails (engines restarting, or not done by a deadline);
  a knob that moved one way does not move back the other way until a dwell has passed.
"""

from __future__ import annotations

import copy

from pagoda_operator.tuning import capacity as engine_capacity
from pagoda_operator.tuning.context import Context
from pagoda_operator.tuning.cover import add_cover, covered, give_back
from pagoda_operator.tuning.judge import watch_pending
from pagoda_operator.tuning.model import (  # noqa: F401  (re-exported: the policy's vocabulary)
    DEFAULT_CONFIG,
    GPU_MEMORY_UTILIZATION,
    KNOBS,
    MAX_NUM_SEQS,
    REPLICAS,
    Action,
    Decision,
    Limits,
    PolicyConfig,
    Proposal,
    Snapshot,
    direction,
    fmt,
)
from pagoda_operator.tuning.rules import first_proposal
from pagoda_operator.tuning.signals import projected_kv, updated_streaks
from pagoda_operator.tuning.state import Pending, TunerState


def decide(
    snapshot: Snapshot | None,
    settings: dict[str, float],
    limits: Limits,
    state: TunerState | None,
    *,
    now: float,
    mode: str,
    rollout_complete: bool = True,
    problem: str = "",
    config: PolicyConfig = DEFAULT_CONFIG,
) -> tuple[Decision, TunerState]:
    """This window's decision and the state to keep for the next one (``state`` itself is
    left as it was).

    ``mode`` is ``Recommend`` (nothing is applied: no cooldown, no change to watch) or
    ``Auto`` (the caller applies a change or revert at once; the state then watches it).
    """
    state = copy.deepcopy(state) if state is not None else TunerState()
    if snapshot is None:
        return _without_metrics(limits, state, now, mode, rollout_complete, problem, config)
    ctx = _observed(snapshot, settings, limits, state, now, mode, rollout_complete, config)
    verdict = None
    if mode != "Auto":
        state.pending = state.cover = None
    elif state.cover is not None and state.cover.phase == "adding":
        return covered(ctx), state
    elif state.pending is not None:
        outcome = watch_pending(snapshot, limits, state, now, rollout_complete, config)
        if isinstance(outcome, Decision):
            return outcome, state
        verdict = outcome
    if mode == "Auto" and state.cover is not None and state.pending is None:
        given_back = give_back(ctx, verdict)
        if given_back is not None:
            return given_back, state
    return _by_the_rules(ctx, mode, verdict), state


def _without_metrics(
    limits: Limits,
    state: TunerState,
    now: float,
    mode: str,
    rollout_complete: bool,
    problem: str,
    config: PolicyConfig,
) -> tuple[Decision, TunerState]:
    """A window without metrics holds, but a change under watch still meets its deadline."""
    if mode == "Auto" and state.pending is not None:
        # Engines that crash at start-up report nothing: the deadline still runs.
        outcome = watch_pending(None, limits, state, now, rollout_complete, config)
        if isinstance(outcome, Decision) and outcome.action == "revert":
            if state.cover is not None and state.cover.phase == "adding":
                state.cover = None  # the engines never came: the change is not made
            return outcome, state
    return Decision("hold", f"holding steady: {problem or 'no metrics'}"), state


def _observed(
    snapshot: Snapshot,
    settings: dict[str, float],
    limits: Limits,
    state: TunerState,
    now: float,
    mode: str,
    rollout_complete: bool,
    config: PolicyConfig,
) -> Context:
    """The window's context, with what the state learns from it: the saturated rate, the
    streaks, an OOM, and the bans that have run out."""
    if rollout_complete and (
        mode != "Auto" or engine_capacity.unchanging(state.pending, snapshot, now)
    ):
        # Only a window in which every engine served throughout says what one can do: none
        # while a change rolls out, but the full window after it that judges it does.
        state.capacity = engine_capacity.updated(
            state.capacity, snapshot, state.streaks.queued, now, limits, config,
            settings.get(MAX_NUM_SEQS),
        )  # fmt: skip
    capacity = engine_capacity.usable(state.capacity, snapshot, config, settings.get(MAX_NUM_SEQS))
    kv_next = projected_kv(snapshot, state.last_kv_usage)
    state.last_kv_usage = snapshot.kv_cache_usage
    state.streaks = updated_streaks(state.streaks, snapshot, limits, capacity, kv_next, config)
    if snapshot.oom_kills:
        state.last_oom_time = now
    state.rejected = [ban for ban in state.rejected if ban.until > now]
    return Context(
        snapshot, settings, limits, state, now, config, capacity, kv_next, rollout_complete
    )


def _by_the_rules(ctx: Context, mode: str, verdict: str | None) -> Decision:
    """The first change the rules propose and the bounds allow, inside a cooldown only one
    that adds capacity; or a hold that says why."""
    state, snapshot, now = ctx.state, ctx.snapshot, ctx.now
    urgent_only = False
    if mode == "Auto" and state.last_change_time is not None:
        remaining = ctx.limits.cooldown_s - (now - state.last_change_time)
        urgent_only = remaining > 0
        if urgent_only and not _escalate(state):
            return Decision("hold", f"cooldown: {remaining:.0f}s left", verdict=verdict)
    proposal, blocked = first_proposal(ctx, urgent_only)
    if proposal is None and urgent_only:
        return Decision("hold", f"cooldown: {remaining:.0f}s left", verdict=verdict)
    if proposal is None:
        reason = f"holding: {blocked}" if blocked else _steady_reason(snapshot, ctx.limits)
        return Decision("hold", reason, verdict=verdict)
    if mode == "Auto" and proposal.cover:
        return add_cover(proposal, ctx, verdict)
    old = ctx.settings[proposal.knob]
    reason = proposal.reason
    if proposal.cover:
        reason += f" (once {proposal.cover} engines more are Ready to cover its rollout)"
    decision = Decision("change", reason, proposal.knob, old, proposal.new, verdict)
    if mode == "Auto":
        state.pending = Pending(proposal.knob, old, proposal.new, now, snapshot.summary())
        state.record_move(proposal.knob, old, proposal.new, now)
    return decision


def _escalate(state: TunerState) -> bool:
    """Whether this window may act before the cooldown ends: the last change has been
    judged. The cooldown is there to judge a change and to keep the knobs steady under
    noise; the first is done once the change is judged, and the second needs no more than
    the rules' own hysteresis for a change that adds capacity (none takes it away inside
    the cooldown, so nothing can flap). Holding those back would leave users without
    service for the rest of it: the demand a calm window's engine-knob change was made
    ahead of, a cache filling, a ramp outrunning the engines. Only changes that add
    capacity are allowed then."""
    return state.pending is None


def _steady_reason(snapshot: Snapshot, limits: Limits) -> str:
    ttft = "n/a" if snapshot.ttft_p95_s is None else f"{snapshot.ttft_p95_s:.3g}s"
    return (
        f"steady: TTFT p95 {ttft} (target {limits.ttft_target_s:g}s), "
        f"{snapshot.requests_waiting:.3g} waiting, KV cache {snapshot.kv_cache_usage:.0%}"
    )
