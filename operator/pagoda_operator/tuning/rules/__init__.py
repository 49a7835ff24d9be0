"""The rules, in order of urgency: each says when it acts (a condition held for enough
windows) and what it proposes; the first proposal ``allowed`` lets through is the change.

The knobs' own rules live in ``replicas``, ``max_num_seqs`` and ``gpu_memory``; this
module only says when each applies and in which order.
"""

from __future__ import annotations

from pagoda_operator.tuning.allowed import allowed, urgent
from pagoda_operator.tuning.capacity import severe
from pagoda_operator.tuning.context import Context
from pagoda_operator.tuning.model import Proposal, fmt
from pagoda_operator.tuning.rules import gpu_memory, max_num_seqs, replicas
from pagoda_operator.tuning.signals import filling_fast


def first_proposal(ctx: Context, urgent_only: bool = False) -> tuple[Proposal | None, str]:
    """The first rule, in order of urgency, whose change is allowed (only those that add
    capacity when ``urgent_only``); else None and why the most urgent one was not."""
    blocked = ""
    for candidate in candidates(ctx):
        if urgent_only and not urgent(candidate, ctx.settings):
            continue
        outcome = allowed(candidate, ctx)
        if isinstance(outcome, Proposal):
            return outcome, ""
        blocked = blocked or f"{candidate.reason}, but {outcome}"
    return None, blocked


def candidates(ctx: Context) -> list[Proposal]:
    """Every rule's proposal for this window, the most urgent first."""
    snapshot, streaks, config = ctx.snapshot, ctx.state.streaks, ctx.config
    if (snapshot.oom_kills or 0) > 0:
        why = f"{fmt(snapshot.oom_kills)} OOM kills in the last window"
        return gpu_memory.after_oom(ctx, why) + max_num_seqs.after_oom(ctx, why)
    proposals: list[Proposal] = []
    storm = snapshot.preemptions_per_s / ctx.pods >= config.storm_preemptions_per_pod_s
    if streaks.preempting >= config.windows_preempting or (streaks.preempting and storm):
        proposals += max_num_seqs.under_preemptions(ctx)
    # A full cache with a queue asks for more memory; one with preemptions first for fewer
    # sequences (above), which ends the recomputation where a few % more cache would not.
    if streaks.kv_bound >= config.windows_up and not streaks.preempting:
        proposals += gpu_memory.for_full_cache(ctx)
    proposals += _under_load(ctx)
    if streaks.calm >= config.windows_up:
        proposals += max_num_seqs.calm_raise(ctx)
    if streaks.idle >= config.windows_down and snapshot.pods > 1:
        proposals += replicas.when_idle(ctx)
    return proposals


def _under_load(ctx: Context) -> list[Proposal]:
    """At most one of the rules for load near or past what the engines serve well: the
    first whose condition holds, from an overload to TTFT near its target."""
    snapshot, streaks, config = ctx.snapshot, ctx.state.streaks, ctx.config
    windows = config.windows_up
    if streaks.overload >= windows or (
        streaks.overload and severe(snapshot, ctx.limits, config)
    ):
        why = overload_reason(ctx)
        return max_num_seqs.overload_raise(ctx, why) + replicas.for_overload(ctx, why)
    if streaks.busy >= windows:
        return replicas.for_busy_engines(ctx)
    if streaks.kv_busy >= windows or (
        streaks.kv_busy and filling_fast(snapshot, ctx.kv_next, config)
    ):
        return replicas.for_filling_cache(ctx)
    if streaks.near_target >= windows:
        return replicas.near_target(ctx)
    return []


def overload_reason(ctx: Context) -> str:
    snapshot, limits = ctx.snapshot, ctx.limits
    parts = []
    if snapshot.ttft_p95_s is not None and snapshot.ttft_p95_s > limits.ttft_target_s:
        parts.append(
            f"TTFT p95 {snapshot.ttft_p95_s:.3g}s over the {limits.ttft_target_s:g}s target"
        )
    if snapshot.requests_waiting > 0:
        parts.append(f"{snapshot.requests_waiting:.3g} requests waiting")
    return " and ".join(parts) or "overloaded"
