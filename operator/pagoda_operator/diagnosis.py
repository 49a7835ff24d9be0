"""Why an LLMDeployment's pods or cache claim do not get going, in the words of the
scheduler, the kubelet and the volume controllers: pods, claims and Events in, a
(reason, message) out. Pure; ``observe`` reads what these functions are given.

Without this the status would say "Progressing" for the Deployment's whole progress deadline
(40 minutes by default) and then "ProgressDeadlineExceeded", and "Downloading the model" for
a claim that never binds, however plain the reason Kubernetes gives.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

# A pod or claim is given this long before its waiting counts as a problem: a cluster
# autoscaler adding a node, or a volume being provisioned, takes a moment.
GRACE_SECONDS = 60
# Container waiting reasons that do not go away by themselves.
CONTAINER_PROBLEMS = (
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "CrashLoopBackOff",
)
# Warning Events of a pod that waits for its volumes (the kubelet, the attach/detach controller).
VOLUME_EVENT_REASONS = ("FailedMount", "FailedAttachVolume")

Problem = tuple[str, str]  # (condition reason, message)


@dataclass(frozen=True)
class Findings:
    """What a reconcile saw besides the owned objects themselves, for the status."""

    pods: Problem | None = None  # the engine pods' problem, if any
    claim_pending: Problem | None = None  # the cache claim is not bound, and why
    # (reason, message) of what the cache claim cannot follow; None without a claim.
    claim_problems: list[Problem] | None = None
    autoscaling: Problem | None = None  # an autoscaler the cluster cannot run
    gateway: Problem | None = None  # spec.routing.gateway the cluster cannot take
    metrics: dict[str, str] | None = None  # the MetricsScraped condition, when checked


NO_FINDINGS = Findings()


def _age_seconds(timestamp: str | None, now: str) -> float:
    if not timestamp:
        return float("inf")
    parse = datetime.datetime.fromisoformat
    delta = parse(now.replace("Z", "+00:00")) - parse(timestamp.replace("Z", "+00:00"))
    return delta.total_seconds()


def _events_of(events: list[dict[str, Any]], kind: str, name: str) -> list[dict[str, Any]]:
    found = [
        event
        for event in events
        if (event.get("involvedObject") or {}).get("kind") == kind
        and (event.get("involvedObject") or {}).get("name") == name
    ]
    return sorted(found, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")


def pod_problem(
    pods: list[dict[str, Any]], events: list[dict[str, Any]], now: str
) -> Problem | None:
    """The first problem among the pods: unschedulable (the scheduler's message: "0/3 nodes
    are available: 3 Insufficient nvidia.com/gpu", a claim not found), an image that cannot
    be pulled, a crash loop (with the last exit code and message), a volume that cannot be
    attached or mounted."""
    for pod in sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name") or ""):
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        if meta.get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
            continue
        name = meta.get("name", "?")
        problem = _unscheduled(status, now) or _container_problem(status)
        if problem is None and status.get("phase") == "Pending":
            problem = _volume_problem(_events_of(events, "Pod", name), meta, now)
        if problem is not None:
            return problem[0], f"pod {name}: {problem[1]}"
    return None


def _unscheduled(status: dict[str, Any], now: str) -> Problem | None:
    for cond in status.get("conditions") or []:
        if cond.get("type") != "PodScheduled" or cond.get("status") != "False":
            continue
        if _age_seconds(cond.get("lastTransitionTime"), now) < GRACE_SECONDS:
            return None
        message = cond.get("message") or cond.get("reason") or "not scheduled"
        if "persistentvolumeclaim" in message and "not found" in message:
            return "PVCNotFound", message
        return cond.get("reason") or "Unschedulable", message
    return None


def _container_problem(status: dict[str, Any]) -> Problem | None:
    statuses = (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or [])
    for container in statuses:
        waiting = (container.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason not in CONTAINER_PROBLEMS:
            continue
        message = f"container {container.get('name')}: {waiting.get('message') or reason}"
        last = (container.get("lastState") or {}).get("terminated") or {}
        if reason == "CrashLoopBackOff" and last:
            message += f"; last exit code {last.get('exitCode')} ({last.get('reason') or '-'})"
            if last.get("message"):
                message += f": {str(last['message']).strip()[-300:]}"
        return reason, message
    return None


def _volume_problem(events: list[dict[str, Any]], meta: dict[str, Any], now: str) -> Problem | None:
    if _age_seconds(meta.get("creationTimestamp"), now) < GRACE_SECONDS:
        return None
    for event in reversed(events):
        if event.get("type") == "Warning" and event.get("reason") in VOLUME_EVENT_REASONS:
            return str(event["reason"]), str(event.get("message") or event["reason"])
    return None


def claim_pending(
    claim: dict[str, Any] | None, events: list[dict[str, Any]], now: str
) -> Problem | None:
    """A cache claim that has not bound for longer than the grace, with what its Events say
    ("no persistent volumes available for this claim and no storage class is set",
    "waiting for first consumer to be created before binding", a provisioner's refusal)."""
    if claim is None or (claim.get("status") or {}).get("phase") == "Bound":
        return None
    meta = claim.get("metadata") or {}
    if _age_seconds(meta.get("creationTimestamp"), now) < GRACE_SECONDS:
        return None
    phase = (claim.get("status") or {}).get("phase") or "Pending"
    messages: list[str] = []
    for event in reversed(_events_of(events, "PersistentVolumeClaim", meta.get("name", ""))):
        text = str(event.get("message") or "")
        if text and text not in messages:
            messages.append(text)
    said = "; ".join(messages[:3]) or "no Events about it yet"
    storage_class = (claim.get("spec") or {}).get("storageClassName")
    where = f"storage class {storage_class}" if storage_class else "no storage class (the default)"
    return f"PVC{phase}", f"claim {meta.get('name')} is {phase} with {where}: {said}"
