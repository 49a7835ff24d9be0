"""The autoscaler an LLMDeployment asks for (``spec.autoscaling``): an HPA on the engines'
queue metrics through prometheus-adapter, or a KEDA ScaledObject that queries Prometheus
itself and, with ``minReplicas: 0``, scales the engines to zero and back on demand."""

from __future__ import annotations

from typing import Any

from pagoda_operator import constants as c
from pagoda_operator.engine_args import served_model_name
from pagoda_operator.metadata import finish
from pagoda_operator.promql import engine_selector


def desired_autoscaler(llmd: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """An HPA on the LLMDeployment's scale subresource, fed by the engine's queue metrics.

    The metric names are the vLLM ones with ':' turned into '_', as a prometheus-adapter
    rule exposes them through the custom metrics API.
    """
    autoscaling = spec["autoscaling"]
    metrics = [_pods_metric("vllm_num_requests_waiting", str(autoscaling["targetRequestsWaiting"]))]
    if autoscaling.get("targetKVCacheUsage") is not None:
        usage_milli = round(float(autoscaling["targetKVCacheUsage"]) * 1000)
        metrics.append(_pods_metric("vllm_kv_cache_usage_perc", f"{usage_milli}m"))
    body = {
        "spec": {
            "scaleTargetRef": {
                "apiVersion": c.API_VERSION,
                "kind": c.KIND,
                "name": llmd["metadata"]["name"],
            },
            "minReplicas": autoscaling["minReplicas"],
            "maxReplicas": autoscaling["maxReplicas"],
            "metrics": metrics,
        }
    }
    return finish(llmd, "autoscaling/v2", "HorizontalPodAutoscaler", body)


KEDA_API_VERSION = "keda.sh/v1alpha1"


def autoscaler_queries(namespace: str, name: str) -> dict[str, str]:
    """The two load signals, summed over this LLMDeployment's engines: KEDA divides a sum
    by the replica count (metricType AverageValue), as the HPA averages per pod."""
    selector = engine_selector(namespace, name)
    return {
        "requests-waiting": f"sum(vllm:num_requests_waiting{{{selector}}})",
        "kv-cache-usage": f"sum(vllm:kv_cache_usage_perc{{{selector}}})",
    }


def prometheus_auth(spec: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The Secrets of ``spec.prometheus`` (bearer token, CA bundle) that are set."""
    prometheus = spec.get("prometheus") or {}
    return {
        field: prometheus[field]
        for field in ("bearerTokenSecretRef", "caSecretRef")
        if prometheus.get(field)
    }


def desired_scaled_object(llmd: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """A KEDA ScaledObject on the LLMDeployment's scale subresource, with Prometheus
    triggers on the same signals as the HPA; KEDA queries ``spec.prometheus.url`` itself,
    so no prometheus-adapter is needed (vLLM production-stack scales the same way)."""
    meta = llmd["metadata"]
    autoscaling = spec["autoscaling"]
    queries = autoscaler_queries(meta["namespace"], meta["name"])
    targets = {"requests-waiting": str(autoscaling["targetRequestsWaiting"])}
    if autoscaling.get("targetKVCacheUsage") is not None:
        targets["kv-cache-usage"] = f"{float(autoscaling['targetKVCacheUsage']):g}"
    auth = prometheus_auth(spec)
    triggers = []
    for signal, threshold in targets.items():
        trigger: dict[str, Any] = {
            "type": "prometheus",
            "name": signal,
            "metricType": "AverageValue",
            "metadata": {
                "serverAddress": spec["prometheus"]["url"],
                "query": queries[signal],
                "threshold": threshold,
                # No engine reporting yet (all loading) is no load, not an error.
                "ignoreNullValues": "true",
            },
        }
        if "bearerTokenSecretRef" in auth:
            trigger["metadata"]["authModes"] = "bearer"
        if auth:
            trigger["authenticationRef"] = {"name": meta["name"]}
        triggers.append(trigger)
    body: dict[str, Any] = {
        "spec": {
            "scaleTargetRef": {"apiVersion": c.API_VERSION, "kind": c.KIND, "name": meta["name"]},
            "minReplicaCount": autoscaling["minReplicas"],
            "maxReplicaCount": autoscaling["maxReplicas"],
            "triggers": triggers,
        }
    }
    if autoscaling["minReplicas"] == 0:
        body["spec"]["cooldownPeriod"] = int(autoscaling.get("idleTimeoutSeconds") or 300)
        demand = demand_trigger(meta["namespace"], meta["name"], spec)
        if triggers and "authenticationRef" in triggers[0]:
            demand["authenticationRef"] = triggers[0]["authenticationRef"]
            demand["metadata"].update(
                {k: v for k, v in triggers[0]["metadata"].items() if k == "authModes"}
            )
        triggers.append(demand)
    return finish(llmd, KEDA_API_VERSION, "ScaledObject", body)


def demand_trigger(namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """With minReplicas 0: what keeps the engines up and what brings them back. Requests
    running (an idle window is one with none) plus requests that pagoda router holds for this
    model while it has no engine (its pagoda_router_held_requests gauge); active above 0.
    Its threshold, maxNumSeqs per replica, is never reached by the running requests alone,
    so it wakes and holds the engines without deciding how many run."""
    selector = engine_selector(namespace, name)
    model = served_model_name(spec)
    held = f'sum(pagoda_router_held_requests{{namespace="{namespace}",model="{model}"}})'
    running = f"sum(vllm:num_requests_running{{{selector}}})"
    return {
        "type": "prometheus",
        "name": "demand",
        "metricType": "AverageValue",
        "metadata": {
            "serverAddress": spec["prometheus"]["url"],
            "query": f"({held} or vector(0)) + ({running} or vector(0))",
            "threshold": str(spec["engine"]["maxNumSeqs"]),
            "activationThreshold": "0",
            "ignoreNullValues": "true",
        },
    }


def desired_trigger_authentication(llmd: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """Hands the Secrets of ``spec.prometheus`` to KEDA's Prometheus triggers."""
    parameters = {"bearerTokenSecretRef": "bearerToken", "caSecretRef": "ca"}
    refs = [
        {"parameter": parameters[field], "name": ref["name"], "key": ref["key"]}
        for field, ref in prometheus_auth(spec).items()
    ]
    return finish(
        llmd, KEDA_API_VERSION, "TriggerAuthentication", {"spec": {"secretTargetRef": refs}}
    )


def _pods_metric(name: str, average_value: str) -> dict[str, Any]:
    return {
        "type": "Pods",
        "pods": {
            "metric": {"name": name},
            "target": {"type": "AverageValue", "averageValue": average_value},
        },
    }
