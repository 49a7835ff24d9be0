"""Reads what the status needs besides the owned objects: the engine pods, Events about them
and the cache claim, and (``metrics``) whether the engines' series reach Prometheus. The
decisions are in ``diagnosis`` and ``metrics``; this module only fetches."""

from __future__ import annotations

from typing import Any

from pagoda_operator.desired import selector_labels
from pagoda_operator.diagnosis import claim_pending, pod_problem
from pagoda_operator.kube import KubeClient, collection_path

Problem = tuple[str, str]
# Events are read for at most this many objects per reconcile (each is one list call).
MAX_EVENT_LOOKUPS = 3


async def events_about(
    client: KubeClient, namespace: str, kind: str, name: str
) -> list[dict[str, Any]]:
    """Events whose involvedObject is ``kind``/``name`` (selected by the server; the pure
    functions check the involvedObject again)."""
    selector = f"involvedObject.kind={kind},involvedObject.name={name}"
    found = await client.request(
        "GET", f"/api/v1/namespaces/{namespace}/events", params={"fieldSelector": selector}
    )
    return list((found or {}).get("items") or [])


async def engine_pod_problem(
    client: KubeClient, namespace: str, name: str, now: str
) -> Problem | None:
    pods = await client.list(collection_path("v1", "Pod", namespace), selector_labels(name))
    problem = pod_problem(pods, [], now)
    if problem is not None:
        return problem
    waiting = [
        (pod.get("metadata") or {}).get("name", "")
        for pod in pods
        if (pod.get("status") or {}).get("phase") == "Pending"
    ]
    events: list[dict[str, Any]] = []
    for pod_name in waiting[:MAX_EVENT_LOOKUPS]:
        events += await events_about(client, namespace, "Pod", pod_name)
    return pod_problem(pods, events, now) if events else None


async def cache_claim_pending(
    client: KubeClient, claim: dict[str, Any] | None, now: str
) -> Problem | None:
    if claim_pending(claim, [], now) is None:
        return None  # bound, or too young to say
    assert claim is not None
    meta = claim["metadata"]
    events = await events_about(client, meta["namespace"], "PersistentVolumeClaim", meta["name"])
    return claim_pending(claim, events, now)
