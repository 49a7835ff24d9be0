"""``status.tuning``, the MetricsAvailable condition and the Events of one tuner window.

Pure: previous status and this window's decision in, new status and Events out.
"""

from __future__ import annotations

from typing import Any

from pagoda_operator.tuning.policy import Decision, Snapshot

HISTORY_LIMIT = 10
METRICS_AVAILABLE = "MetricsAvailable"

# (event type, reason, message)
Event = tuple[str, str, str]


def decision_entry(
    decision: Decision,
    *,
    mode: str,
    now: str,
    snapshot: Snapshot | None,
    settings: dict[str, float],
    outcome: str,
) -> dict[str, Any]:
    return {
        "time": now,
        "mode": mode,
        "action": decision.action,
        "knob": decision.knob,
        "from": decision.old,
        "to": decision.new,
        "reason": decision.reason,
        "outcome": outcome,
        "inputs": snapshot.summary() if snapshot is not None else None,
        "settings": dict(settings),
    }


def tuning_status(
    previous: dict[str, Any],
    decision: Decision,
    state: dict[str, Any],
    *,
    mode: str,
    now: str,
    snapshot: Snapshot | None,
    settings: dict[str, float],
    fixed: dict[str, str],
) -> tuple[dict[str, Any], list[Event]]:
    """The new ``status.tuning`` (keys that must go are None, for a merge patch) and the
    Events that announce what changed."""
    decisions = [dict(entry) for entry in previous.get("decisions") or []]
    events: list[Event] = []
    if decision.verdict is not None:
        _settle_last_applied(decisions, decision, events)
    recommendation = None
    if decision.action == "change" and mode == "Recommend":
        recommendation = {
            "knob": decision.knob,
            "from": decision.old,
            "to": decision.new,
            "reason": decision.reason,
            "time": now,
        }
        if not _same_proposal(previous.get("recommendation"), recommendation):
            decisions.append(_entry(decision, mode, now, snapshot, settings, "recommended"))
            events.append(("Normal", "TuningRecommendation", _describe(decision)))
        else:
            recommendation["time"] = previous["recommendation"].get("time", now)
    elif decision.action == "change":
        decisions.append(_entry(decision, mode, now, snapshot, settings, "watching"))
        events.append(("Normal", "TuningApplied", _describe(decision)))
    elif decision.action == "revert":
        decisions.append(_entry(decision, mode, now, snapshot, settings, "applied"))
        events.append(("Warning", "TuningReverted", _describe(decision)))
    status = {
        "mode": mode,
        "lastEvaluationTime": now,
        "lastDecision": {"time": now, **decision.as_dict()},
        "observation": snapshot.summary() if snapshot is not None else None,
        "settings": dict(settings),
        "fixed": dict(fixed) or None,
        "recommendation": recommendation,
        "decisions": decisions[-HISTORY_LIMIT:],
        "state": state,
    }
    return status, events


def _entry(
    decision: Decision,
    mode: str,
    now: str,
    snapshot: Snapshot | None,
    settings: dict[str, float],
    outcome: str,
) -> dict[str, Any]:
    return decision_entry(
        decision, mode=mode, now=now, snapshot=snapshot, settings=settings, outcome=outcome
    )


def _settle_last_applied(
    decisions: list[dict[str, Any]], decision: Decision, events: list[Event]
) -> None:
    """Writes the verdict into the applied change it judges."""
    for entry in reversed(decisions):
        if entry.get("outcome") == "watching":
            kept = decision.action != "revert"
            entry["outcome"] = ("kept: " if kept else "reverted: ") + str(decision.verdict)
            if kept:
                events.append(("Normal", "TuningKept", str(decision.verdict)))
            return


def _same_proposal(before: dict[str, Any] | None, after: dict[str, Any]) -> bool:
    return before is not None and all(before.get(k) == after[k] for k in ("knob", "from", "to"))


def _describe(decision: Decision) -> str:
    return f"{decision.knob} {decision.old:g} -> {decision.new:g}: {decision.reason}"


def metrics_condition(snapshot: Snapshot | None, reason: str, problem: str) -> dict[str, str]:
    if snapshot is not None:
        message = f"{snapshot.pods} engines reporting"
        if snapshot.oom_kills is None:
            message += "; no kube-state-metrics series, so no restart/OOM signal"
        return {
            "type": METRICS_AVAILABLE,
            "status": "True",
            "reason": "SeriesPresent",
            "message": message,
        }
    return {
        "type": METRICS_AVAILABLE,
        "status": "False",
        "reason": reason or "Unavailable",
        "message": f"Holding every knob steady: {problem}",
    }


def condition_events(previous: list[dict[str, Any]], current: dict[str, str]) -> list[Event]:
    """An Event when the metrics condition flips (or first appears False)."""
    before = next((c for c in previous or [] if c.get("type") == METRICS_AVAILABLE), None)
    if before is not None and before.get("status") == current["status"]:
        return []
    if current["status"] == "False":
        return [("Warning", f"Metrics{current['reason']}", current["message"])]
    if before is not None:
        return [("Normal", "MetricsAvailable", current["message"])]
    return []
