"""Reads what the status needs besides the owned objects: the engine pods, Events about them
and the cache claim, and (``metrics``) whether the engines' series reach Prometheus. The
decisions are in ``diagnosis`` and ``metrics``; this module only fetches."""

from __future__ import annotations

import ssl
from typing import Any

import aiohttp

from pagoda_operator.diagnosis import claim_pending, pod_problem
from pagoda_operator.kube import KubeClient, KubeError, collection_path
from pagoda_operator.metadata import selector_labels
from pagoda_operator.metrics import (
    scraped_condition,
    series_query,
    unreachable_condition,
    unscraped_cause,
)

Problem = tuple[str, str]
# Events are read for at most this many objects per reconcile (each is one list call).
MAX_EVENT_LOOKUPS = 3
MONITORING_API = "monitoring.coreos.com/v1"
QUERY_TIMEOUT_SECONDS = 10


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


async def prometheus_objects(client: KubeClient) -> list[dict[str, Any]] | None:
    """The Prometheus Operator's Prometheus objects, cluster-wide; None when not readable."""
    try:
        found = await client.request("GET", f"/apis/{MONITORING_API}/prometheuses")
    except KubeError:
        return None  # an older ClusterRole: the cause is then said less precisely
    return None if found is None else list(found.get("items") or [])


async def metrics_finding(
    client: KubeClient,
    llmd: dict[str, Any],
    *,
    monitor_labels: dict[str, str] | None,
    operator_monitors: bool,
) -> dict[str, str]:
    """The MetricsScraped condition from one query of ``spec.prometheus.url``.
    ``monitor_labels``: the labels of the operator's ServiceMonitor, None when the cluster
    serves no ServiceMonitors."""
    # The tuner's runner imports the reconciler, which calls this: imported here.
    from pagoda_operator.tuning.prometheus import PrometheusError, instant_query
    from pagoda_operator.tuning.runner import CredentialsError, prometheus_endpoint

    meta, spec = llmd["metadata"], llmd.get("spec") or {}
    url = spec["prometheus"]["url"]
    query = series_query(meta["namespace"], meta["name"])
    try:
        endpoint = await prometheus_endpoint(client, meta["namespace"], spec["prometheus"])
        connector = aiohttp.TCPConnector(ssl=endpoint.ssl_context() or True)
        timeout = aiohttp.ClientTimeout(total=QUERY_TIMEOUT_SECONDS)
        async with aiohttp.ClientSession(
            timeout=timeout, headers=endpoint.headers(), connector=connector
        ) as session:
            result = await instant_query(session, url, query)
    except (CredentialsError, PrometheusError, ssl.SSLError, ValueError) as error:
        return unreachable_condition(url, str(error))
    engines = int(float(result[0]["value"][1])) if result else 0
    cause = ""
    if not engines:
        cause = unscraped_cause(
            service_monitor_api=monitor_labels is not None,
            operator_monitors=operator_monitors,
            monitor_labels=monitor_labels or {},
            namespace=meta["namespace"],
            prometheuses=await prometheus_objects(client) if monitor_labels is not None else None,
        )
    return scraped_condition(engines, url, query, cause)
