"""Watching an applied change: revert it when its rollout fails, else judge it on the first
full window after its rollout: keep or revert.

A rollout fails when the engines restart while it runs (a CUDA out-of-memory error at start-up
is a process exit, so a crash loop, not an ``OOMKilled``), or when it has not completed within
``Limits.rollout_deadline_s`` of the change (a pod that cannot be scheduled, a model load that
never ends). Either way the value goes back and is banned like any reverted one.
"""

from __future__ import annotations

from typing import Any

from pagoda_operator.tuning.model import (
    REPLICAS,
    Decision,
    Limits,
    PolicyConfig,
    Snapshot,
    direction,
    fmt,
)
from pagoda_operator.tuning.state import Ban, Pending, TunerState


def watch_pending(
    snapshot: Snapshot | None,
    limits: Limits,
    state: TunerState,
    now: float,
    rollout_complete: bool,
    config: PolicyConfig,
) -> Decision | str:
    """A hold while the change is still rolling out or settling; otherwise its verdict
    (a revert Decision when its rollout failed or it made things worse, a "kept" string
    when not). Without a snapshot only the rollout deadline can be judged."""
    pending = state.pending
    assert pending is not None
    change = f"{pending.knob} {fmt(pending.from_)} -> {fmt(pending.to)}"
    if not rollout_complete or snapshot is None:
        pending.settled_time = None
        failure = _rollout_failure(pending, snapshot, limits, now)
        if failure is not None:
            return revert(state, f"reverted {change}: {failure}", now, limits, config)
        return Decision("hold", f"waiting for the rollout of {change}")
    # Written as None while the rollout ran, so absent from the stored state: in a merge
    # patch of the status (RFC 7386) a null removes its key.
    settled = pending.settled_time
    if settled is None:
        pending.settled_time = settled = now
    if now - settled < snapshot.window_s:
        return Decision("hold", f"watching the first full window after {change}")
    worse = _made_worse(pending, snapshot, limits, config)
    if worse is None:
        state.pending = None
        return f"kept {change}: {_outcome_summary(pending.baseline, snapshot)}"
    return revert(state, f"reverted {change}: {worse}", now, limits, config)


def revert(
    state: TunerState, reason: str, now: float, limits: Limits, config: PolicyConfig
) -> Decision:
    """Undoes the pending change and bans its value for ``reject_cooldowns`` cooldowns."""
    pending, state.pending = state.pending, None
    assert pending is not None
    knob, old, new = pending.knob, pending.to, pending.from_
    until = now + config.reject_cooldowns * limits.cooldown_s
    state.rejected.append(Ban(knob, old, direction(new, old), until))
    state.record_move(knob, old, new, now)
    return Decision("revert", reason, knob, old, new, verdict=reason)


def _rollout_failure(
    pending: Pending, snapshot: Snapshot | None, limits: Limits, now: float
) -> str | None:
    """Why the rollout of the pending change has failed, or None while it may still finish."""
    restarts = None if snapshot is None else snapshot.restarts
    if restarts:
        return f"{fmt(restarts)} engine restarts while it rolled out"
    elapsed = now - pending.time
    if elapsed > limits.rollout_deadline_s:
        return f"rollout not complete {elapsed:.0f}s after the change (deadline {limits.rollout_deadline_s:g}s)"
    return None


def _made_worse(
    pending: Pending, snapshot: Snapshot, limits: Limits, config: PolicyConfig
) -> str | None:
    """Why the window after the change is worse than the one before it, or None.

    Each kind of change is judged by what it can break. Adding replicas cannot make an
    engine slower (latency that is still high is a backlog draining), and lowering an
    engine knob was a safety move: neither is reverted. Raising an engine knob can cause
    OOM kills, preemptions or a throughput loss; removing a replica can break the SLO.

    Rates are compared per engine: a change rolled out on engines added to cover it (see
    ``cover.cover_engines``) is judged against the window before they came, and the
    added engines must not pass for what the new value serves.
    """
    baseline = pending.baseline
    per_engine = max(snapshot.pods, 1) / max(baseline.get("pods") or snapshot.pods, 1)
    raised = pending.to > pending.from_
    if pending.knob == REPLICAS:
        return None if raised else _latency_regression(baseline, snapshot, limits, config)
    if not raised:
        return None
    if (snapshot.oom_kills or 0) > 0:
        return f"{fmt(snapshot.oom_kills)} OOM kills after raising it"
    if (snapshot.restarts or 0) > 0:
        return f"{fmt(snapshot.restarts)} engine restarts after raising it"
    before_preempt = (baseline.get("preemptionsPerSecond") or 0.0) * per_engine
    preempt_floor = config.preemptions_per_pod_s * max(snapshot.pods, 1)
    if (
        snapshot.preemptions_per_s > preempt_floor
        and snapshot.preemptions_per_s > before_preempt * 2 + preempt_floor
    ):
        return f"preemptions {before_preempt:.3g}/s -> {snapshot.preemptions_per_s:.3g}/s"
    # Throughput lost: the engines' work (prompt and generated tokens) and their generated
    # tokens both fell. Either alone is bursty over one window. A rollout restarts every
    # engine, and in the first window after it each one prefills the requests it admits
    # from the queue again before it decodes them, so generated tokens dip even when the
    # new value serves as fast (seen in the live test: 10.7 -> 1.3 generated tok/s while
    # prompt tokens stayed at 41-43/s). And a window in which no request happens to finish
    # admits none, so prompt tokens drop to nothing while decoding goes on as fast (seen
    # there too: 32 -> 0 prompt tok/s, 6.7 -> 5.3 generated).
    before_generated = per_engine * (baseline.get("generationTokensPerSecond") or 0.0)
    before_tokens = before_generated + per_engine * (baseline.get("promptTokensPerSecond") or 0.0)
    after_tokens = snapshot.generation_tokens_per_s + snapshot.prompt_tokens_per_s
    ratio = config.worse_throughput_ratio
    if (
        snapshot.requests_waiting > 0
        and after_tokens < ratio * before_tokens
        and snapshot.generation_tokens_per_s < ratio * before_generated
    ):
        return (
            f"tokens processed (prompt + generated) {before_tokens:.4g} -> {after_tokens:.4g}/s, "
            f"generated {before_generated:.4g} -> {snapshot.generation_tokens_per_s:.4g}/s, "
            "with requests still waiting"
        )
    before_itl, after_itl = baseline.get("itlP95Seconds"), snapshot.itl_p95_s
    if (
        limits.itl_target_s is not None
        and after_itl is not None
        and after_itl > limits.itl_target_s
        and after_itl > (before_itl or 0.0) * config.worse_ratio
    ):
        return f"ITL p95 {fmt(before_itl)}s -> {after_itl:.3g}s, above {limits.itl_target_s:g}s"
    return None


def _latency_regression(
    baseline: dict[str, Any], snapshot: Snapshot, limits: Limits, config: PolicyConfig
) -> str | None:
    before_ttft, after_ttft = baseline.get("ttftP95Seconds"), snapshot.ttft_p95_s
    if (
        after_ttft is not None
        and after_ttft > limits.ttft_target_s
        and after_ttft > (before_ttft or 0.0) * config.worse_ratio + config.worse_margin_s
    ):
        before = "n/a" if before_ttft is None else f"{before_ttft:.3g}s"
        return f"TTFT p95 {before} -> {after_ttft:.3g}s, above the {limits.ttft_target_s:g}s target"
    return None


def _outcome_summary(baseline: dict[str, Any], snapshot: Snapshot) -> str:
    before = baseline.get("ttftP95Seconds")
    after = snapshot.ttft_p95_s
    if before is None or after is None:
        return "no latency regression"
    return f"TTFT p95 {before:.3g}s -> {after:.3g}s"
