"""LLMDeployment status: phase, replica counts and the Available/Progressing/Degraded conditions.

Pure functions of the LLMDeployment, its Deployment (if any) and the current time.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from pagoda_operator.desired import effective_replicas
from pagoda_operator.diagnosis import NO_FINDINGS, Findings
from pagoda_operator.gateway import gateway_spec
from pagoda_operator.live_adapters import ADAPTERS_READY, AdapterReport
from pagoda_operator.metadata import selector_string
from pagoda_operator.model_cache import CacheState
from pagoda_operator.overrides import GPU_MEMORY_UTILIZATION, MAX_NUM_SEQS, effective_spec

AVAILABLE = "Available"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
MODEL_CACHED = "ModelCached"
MODEL_CACHE_SYNCED = "ModelCacheSynced"  # the cache claim follows spec.model.cache
AUTOSCALING_READY = "AutoscalingReady"  # the autoscaler the spec asks for can run here
GATEWAY_READY = "GatewayReady"  # spec.routing.gateway's InferencePool can exist here
CONDITION_TYPES = (
    AVAILABLE,
    PROGRESSING,
    DEGRADED,
    MODEL_CACHED,
    MODEL_CACHE_SYNCED,
    AUTOSCALING_READY,
    GATEWAY_READY,
    ADAPTERS_READY,  # every Ready engine serves spec.adapters (``live_adapters``)
)

# Reasons that come from the LLMDeployment itself rather than from its pods: they hold until
# the spec changes, whatever the Deployment reports meanwhile.
SPEC_PROBLEM_REASONS = ("InvalidSpec", "ApplyFailed", "NameConflict")


def now_rfc3339() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(kind: str, is_true: bool, reason: str, message: str) -> dict[str, str]:
    return {
        "type": kind,
        "status": "True" if is_true else "False",
        "reason": reason,
        "message": message,
    }


def merge_conditions(
    previous: list[dict[str, Any]], current: list[dict[str, Any]], now: str
) -> list[dict[str, Any]]:
    """``current`` with lastTransitionTime kept where a condition's status did not change."""
    previous_by_type = {cond.get("type"): cond for cond in previous or []}
    merged = []
    for cond in current:
        before = previous_by_type.get(cond["type"])
        unchanged = before is not None and before.get("status") == cond["status"]
        transition = before.get("lastTransitionTime") if unchanged else None
        merged.append({**cond, "lastTransitionTime": transition or now})
    return merged


def foreign_conditions(conditions: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Conditions other parts of the operator own (the tuner's MetricsAvailable): carried
    over unchanged, since a merge patch of ``conditions`` replaces the whole list."""
    return [
        {key: value for key, value in cond.items() if key != "lastTransitionTime"}
        for cond in conditions or []
        if cond.get("type") not in CONDITION_TYPES
    ]


def set_condition(
    conditions: list[dict[str, Any]] | None, new: dict[str, Any], now: str
) -> list[dict[str, Any]]:
    """``conditions`` with the one of ``new``'s type replaced (or added), the rest as they are."""
    previous = list(conditions or [])
    others = [cond for cond in previous if cond.get("type") != new["type"]]
    merged = merge_conditions(previous, [new], now)
    return others + merged


def spec_problem_status(
    llmd: dict[str, Any], reason: str, message: str, now: str
) -> dict[str, Any]:
    """Degraded because of the spec; Available and Progressing keep what they said before."""
    previous = llmd.get("status") or {}
    previous_conditions = previous.get("conditions") or []
    kept = [
        {key: value for key, value in cond.items() if key != "lastTransitionTime"}
        for cond in previous_conditions
        if cond.get("type") in (AVAILABLE, PROGRESSING)
    ]
    known = {cond["type"] for cond in kept}
    if AVAILABLE not in known:
        kept.append(condition(AVAILABLE, False, reason, "Nothing deployed for this spec"))
    if PROGRESSING not in known:
        kept.append(condition(PROGRESSING, False, reason, "Waiting for a valid spec"))
    current = kept + [condition(DEGRADED, True, reason, message)]
    current.sort(key=lambda cond: CONDITION_TYPES.index(cond["type"]))
    # The verdict is about this generation; what served before keeps the generation it saw.
    generation = (llmd.get("metadata") or {}).get("generation")
    current = [
        {
            **cond,
            "observedGeneration": generation
            if cond["type"] == DEGRADED
            else cond.get("observedGeneration", generation),
        }
        for cond in current
    ]
    current += foreign_conditions(previous_conditions)
    return {
        "phase": DEGRADED,
        "observedGeneration": (llmd.get("metadata") or {}).get("generation"),
        "conditions": merge_conditions(previous_conditions, current, now),
    }


def workload_status(
    llmd: dict[str, Any],
    deployment: dict[str, Any] | None,
    now: str,
    *,
    keep_spec_problem: bool = True,
    cache: CacheState | None = None,
    applied_generation: int | None = None,
    findings: Findings = NO_FINDINGS,
    adapters: AdapterReport | None = None,
) -> dict[str, Any]:
    """The status that the Deployment's own status (and the model cache's, for downloaded
    weights) implies for its LLMDeployment; ``adapters``: how the engines serve the spec's
    adapters (None: LoRA is off).

    ``keep_spec_problem=False`` is for right after a successful apply of the current spec,
    which settles any earlier InvalidSpec/ApplyFailed verdict. ``applied_generation``: the
    generation whose spec the Deployment runs, when that is not the current one (an update
    held back until the model cache is ready); it is what ``observedGeneration`` and the
    workload conditions report, so no generation is stamped before it was applied.
    """
    spec = effective_spec(llmd)
    meta = llmd.get("metadata") or {}
    previous = llmd.get("status") or {}
    desired = effective_replicas(spec)
    counts = _replica_counts(deployment)
    phase, current = _conditions_for(desired, counts, deployment)
    if findings.pods is not None and desired > 0:
        # The pods' own reason, at once, rather than a rollout that "progresses" until its
        # deadline and then says only ProgressDeadlineExceeded.
        phase = DEGRADED
        current = [c for c in current if c["type"] != DEGRADED]
        current.append(condition(DEGRADED, True, *findings.pods))
    if cache is not None:
        if findings.claim_pending is not None and not (cache.ready or cache.failed):
            cache = dataclasses.replace(
                cache, reason=findings.claim_pending[0], message=findings.claim_pending[1]
            )
        phase, current = _with_model_cache(phase, current, cache, counts["ready"], desired)
    current += _integration_conditions(findings, bool(spec["autoscaling"]["enabled"]))
    current += _gateway_conditions(findings, gateway_spec(spec) is not None)
    if adapters is not None:
        current.append(adapters.condition)
    generation = meta.get("generation")
    applied = generation if applied_generation is None else applied_generation
    current = [
        {**cond, "observedGeneration": generation if cond["type"] == MODEL_CACHED else applied}
        for cond in current
    ]

    spec_problem = _standing_spec_problem(llmd) if keep_spec_problem else None
    if spec_problem is not None:
        current = [cond for cond in current if cond["type"] != DEGRADED] + [spec_problem]
        phase = DEGRADED
    current = current + foreign_conditions(previous.get("conditions"))
    if findings.metrics is not None:
        current = [c for c in current if c["type"] != findings.metrics["type"]]
        current.append(findings.metrics)

    return {
        "phase": phase,
        "replicas": counts["replicas"],
        "readyReplicas": counts["ready"],
        "updatedReplicas": counts["updated"],
        "observedGeneration": applied,
        "selector": selector_string(meta["name"]),
        "modelName": (spec.get("model") or {}).get("servedModelName")
        or (spec.get("model") or {}).get("name"),
        "serviceName": meta["name"],
        "coldStart": cold_start(
            previous.get("coldStart"), previous.get("phase"), desired, counts["ready"], now
        ),
        # None removes a record left from an earlier download source (merge patch).
        "modelCache": cache.status(spec, meta["name"]) if cache is not None else None,
        "adapters": adapters.entries if adapters is not None else None,
        # What the engines are told to run: the spec with the tuner's overrides.
        "effective": {
            "replicas": desired,
            MAX_NUM_SEQS: spec["engine"][MAX_NUM_SEQS],
            GPU_MEMORY_UTILIZATION: spec["engine"][GPU_MEMORY_UTILIZATION],
        },
        "conditions": merge_conditions(previous.get("conditions") or [], current, now),
    }


def _integration_conditions(findings: Findings, autoscaled: bool) -> list[dict[str, str]]:
    """ModelCacheSynced (with a download source) and AutoscalingReady (with autoscaling on)."""
    result = []
    if findings.claim_problems is not None:
        problems = findings.claim_problems
        result.append(
            condition(MODEL_CACHE_SYNCED, False, problems[0][0], "; ".join(m for _, m in problems))
            if problems
            else condition(MODEL_CACHE_SYNCED, True, "AsSpecified", "The claim follows the spec")
        )
    if findings.autoscaling is not None:
        result.append(condition(AUTOSCALING_READY, False, *findings.autoscaling))
    elif autoscaled:
        result.append(condition(AUTOSCALING_READY, True, "AsExpected", "The autoscaler can run"))
    return result


def cold_start(
    previous: dict[str, Any] | None, previous_phase: str | None, desired: int, ready: int, now: str
) -> dict[str, Any] | None:
    """``status.coldStart``: a start from zero replicas begins when replicas are wanted
    after ScaledToZero and ends at the first ready replica, whose wait it records."""
    record = {k: v for k, v in (previous or {}).items() if v is not None}
    if desired > 0 and ready == 0 and previous_phase == "ScaledToZero":
        record.setdefault("startedAt", now)
    if ready >= 1 and record.get("startedAt"):
        parse = datetime.datetime.fromisoformat
        started = parse(record["startedAt"].replace("Z", "+00:00"))
        waited = parse(now.replace("Z", "+00:00")) - started
        # None removes startedAt in the merge patch of the status.
        record.update(startedAt=None, lastSeconds=round(waited.total_seconds(), 1),
                      lastReadyAt=now)  # fmt: skip
    return record or None


def _gateway_conditions(findings: Findings, gateway: bool) -> list[dict[str, str]]:
    """GatewayReady, with spec.routing.gateway set."""
    if findings.gateway is not None:
        return [condition(GATEWAY_READY, False, *findings.gateway)]
    if gateway:
        message = "The InferencePool and its endpoint picker are applied"
        return [condition(GATEWAY_READY, True, "AsExpected", message)]
    return []


def _with_model_cache(
    phase: str, current: list[dict[str, str]], cache: CacheState, ready: int, desired: int
) -> tuple[str, list[dict[str, str]]]:
    """Adds ModelCached; a failed loader degrades, a loading one holds a fresh deployment."""
    by_type = {cond["type"]: cond for cond in current}
    if cache.failed:
        phase = DEGRADED
        by_type[DEGRADED] = condition(
            DEGRADED, True, cache.reason, f"Model loader: {cache.message}"
        )
    elif not cache.ready and ready == 0 and desired > 0:
        phase = "Pending"
        by_type[AVAILABLE] = condition(AVAILABLE, False, "ModelLoading", cache.message)
        by_type[PROGRESSING] = condition(PROGRESSING, True, "ModelLoading", cache.message)
    by_type[MODEL_CACHED] = condition(MODEL_CACHED, cache.ready, cache.reason, cache.message)
    return phase, [by_type[kind] for kind in CONDITION_TYPES if kind in by_type]


def _replica_counts(deployment: dict[str, Any] | None) -> dict[str, Any]:
    dep_status = (deployment or {}).get("status") or {}
    dep_generation = ((deployment or {}).get("metadata") or {}).get("generation")
    observed = dep_status.get("observedGeneration")
    # The emulator and brand-new objects may carry no generation at all: nothing to wait for.
    caught_up = dep_generation is None or (observed is not None and observed >= dep_generation)
    return {
        "replicas": int(dep_status.get("replicas") or 0),
        "ready": int(dep_status.get("readyReplicas") or 0),
        "updated": int(dep_status.get("updatedReplicas") or 0),
        "caught_up": caught_up,
        "failure": _deployment_failure(dep_status),
    }


def _deployment_failure(dep_status: dict[str, Any]) -> tuple[str, str] | None:
    for cond in dep_status.get("conditions") or []:
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return cond.get("reason") or "ReplicaFailure", cond.get("message") or ""
        if (
            cond.get("type") == "Progressing"
            and cond.get("status") == "False"
            and cond.get("reason") == "ProgressDeadlineExceeded"
        ):
            return "ProgressDeadlineExceeded", cond.get("message") or ""
    return None


def _conditions_for(
    desired: int, counts: dict[str, Any], deployment: dict[str, Any] | None
) -> tuple[str, list[dict[str, str]]]:
    ready, updated, total = counts["ready"], counts["updated"], counts["replicas"]
    if deployment is None:
        return "Pending", [
            condition(AVAILABLE, False, "DeploymentMissing", "The Deployment is not created yet"),
            condition(PROGRESSING, True, "Creating", "Creating the Deployment"),
            condition(DEGRADED, False, "AsExpected", ""),
        ]
    if desired == 0:
        return "ScaledToZero", [
            condition(AVAILABLE, False, "ScaledToZero", "spec.replicas is 0"),
            condition(PROGRESSING, False, "ScaledToZero", "spec.replicas is 0"),
            condition(DEGRADED, False, "AsExpected", ""),
        ]
    rolled_out = counts["caught_up"] and updated >= desired and total <= desired
    ready_message = f"{ready}/{desired} replicas ready"
    available = (
        condition(AVAILABLE, True, "ReplicasReady", ready_message)
        if ready >= 1
        else condition(AVAILABLE, False, "NoReplicaReady", f"{ready_message}; loading the model")
    )
    progressing = (
        condition(PROGRESSING, False, "RolloutComplete", f"{updated}/{desired} replicas updated")
        if rolled_out and ready >= desired
        else condition(
            PROGRESSING, True, "RollingOut", f"{updated}/{desired} replicas updated, {ready} ready"
        )
    )
    failure = counts["failure"]
    degraded = (
        condition(DEGRADED, True, failure[0], failure[1])
        if failure
        else condition(DEGRADED, False, "AsExpected", "")
    )
    if failure:
        phase = DEGRADED
    elif progressing["status"] == "False":
        phase = AVAILABLE
    else:
        phase = PROGRESSING
    return phase, [available, progressing, degraded]


def _standing_spec_problem(llmd: dict[str, Any]) -> dict[str, str] | None:
    """A spec-caused Degraded condition still valid for the current generation, if any."""
    status = llmd.get("status") or {}
    generation = (llmd.get("metadata") or {}).get("generation")
    if status.get("observedGeneration") != generation:
        return None
    for cond in status.get("conditions") or []:
        if (
            cond.get("type") == DEGRADED
            and cond.get("status") == "True"
            and cond.get("reason") in SPEC_PROBLEM_REASONS
        ):
            return {key: cond[key] for key in ("type", "status", "reason", "message")}
    return None


def needs_recheck(llmd: dict[str, Any]) -> bool:
    """Whether the periodic pass should reconcile this LLMDeployment although nothing it
    watches changed: a claim that stays Pending, a pod that stays unschedulable, KEDA
    installed later and a Prometheus that still lacks the series change no owned object, yet their reasons must
    reach the status within one pass. A settled one (Available, or scaled to zero, with its
    metrics seen or not asked for) and a spec problem (waits for a new spec) are left."""
    status = llmd.get("status") or {}
    if _standing_spec_problem(llmd) is not None:
        return False
    if status.get("phase") not in (AVAILABLE, "ScaledToZero"):
        return True
    by_type = {cond.get("type"): cond for cond in status.get("conditions") or []}
    integrations = (AUTOSCALING_READY, GATEWAY_READY, ADAPTERS_READY)
    if "False" in {(by_type.get(kind) or {}).get("status") for kind in integrations}:
        # KEDA, the metrics adapter or the InferencePool CRD may have been installed since;
        # an engine may take an adapter now, and the engines' start-up list must leave out
        # one that was refused.
        return True
    if not ((llmd.get("spec") or {}).get("prometheus") or {}).get("url"):
        return False
    return (by_type.get("MetricsScraped") or {}).get("status") != "True"


def status_differs(old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """Whether patching ``new`` would change anything in ``old``."""
    old = old or {}
    return any(old.get(key) != value for key, value in new.items())


def phase_event(old_phase: str | None, new_status: dict[str, Any]) -> tuple[str, str, str] | None:
    """(event type, reason, message) for a phase change, or None when the phase stayed."""
    new_phase = new_status.get("phase")
    if new_phase == old_phase:
        return None
    message = f"Phase {old_phase or 'None'} -> {new_phase}"
    for cond in new_status.get("conditions") or []:
        if cond["type"] == (DEGRADED if new_phase == DEGRADED else AVAILABLE):
            message += f": {cond.get('message') or cond.get('reason')}"
    event_type = "Warning" if new_phase == DEGRADED else "Normal"
    return event_type, f"Phase{new_phase}", message


def model_cache_event(
    old_status: dict[str, Any], new_status: dict[str, Any]
) -> tuple[str, str, str] | None:
    """(event type, reason, message) when the ModelCached condition changed its verdict."""

    def verdict(status: dict[str, Any]) -> tuple[str, str] | None:
        for cond in status.get("conditions") or []:
            if cond.get("type") == MODEL_CACHED:
                return cond.get("status", ""), cond.get("reason", "")
        return None

    new = verdict(new_status)
    if new is None or new == verdict(old_status or {}):
        return None
    cond = next(c for c in new_status["conditions"] if c["type"] == MODEL_CACHED)
    if new[0] == "True":
        return "Normal", "ModelCached", cond.get("message", "")
    failed = (new_status.get("modelCache") or {}).get("state") == "Failed"
    if failed or new[1] in ("CreateContainerConfigError", "ErrImagePull", "ImagePullBackOff"):
        return "Warning", f"ModelLoader{new[1]}", cond.get("message", "")
    return "Normal", "ModelLoading", cond.get("message", "")
