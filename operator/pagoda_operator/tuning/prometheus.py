"""What the tuner asks Prometheus, and one window's answer as a ``Snapshot``.

Label contract: every engine series carries ``namespace`` and ``llmdeployment`` labels, the
namespace of the pod and the value of its ``pagoda.dev/llmdeployment`` label. The relabelling
that produces them (Kubernetes pod service discovery, or a ServiceMonitor) is in
operator/README.md. Restarts and OOM kills come from kube-state-metrics, which labels its
series with ``namespace``, ``pod`` and ``container``; an engine's pods are found through
``kube_pod_owner``, whose owner is the ReplicaSet ``<name>-<template hash>``: pod names
themselves are cut to 58 characters before their random suffix, so a long name cannot be
matched by a pattern over the pod's name.

Names are quoted by ``promql``.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import ssl
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pagoda_operator.promql import engine_selector, promql_string
from pagoda_operator.tuning.policy import Snapshot

QUERY_TIMEOUT_SECONDS = 10
ENGINE_CONTAINER = "engine"
INFO_METRIC = "pagoda:engine_config_info"

# Series every engine exports: without them the tuner has nothing to stand on.
REQUIRED = (
    "pods",
    "kv_cache_usage",
    "requests_waiting",
    "requests_running",
    "preemptions_per_s",
    "generation_tokens_per_s",
    "requests_per_s",
    "aborted_per_s",
    "queue_growth_per_s",
    "prompt_tokens_per_s",
    "ttft_p95_s",
    "itl_p95_s",
)


def owner_selector(namespace: str, name: str) -> str:
    """kube_pod_owner series of the pods of this LLMDeployment's Deployment: owned by one
    of its ReplicaSets, ``<name>-<pod template hash>`` (the hash has no ``-``)."""
    replica_sets = promql_string(f"{re.escape(name)}-[a-z0-9]+")
    return (
        f'namespace={promql_string(namespace)},owner_kind="ReplicaSet",owner_name=~{replica_sets}'
    )


def engine_container_selector(namespace: str) -> str:
    return f"namespace={promql_string(namespace)},container={promql_string(ENGINE_CONTAINER)}"


def snapshot_queries(namespace: str, name: str, window_s: float) -> dict[str, str]:
    """PromQL for each Snapshot field, over the window that ends now."""
    sel = engine_selector(namespace, name)
    containers = engine_container_selector(namespace)
    w = f"{max(1, math.ceil(window_s))}s"

    def p95(histogram: str) -> str:
        return f"histogram_quantile(0.95, sum by (le) (rate({histogram}_bucket{{{sel}}}[{w}])))"

    owned = f"max by (namespace, pod) (kube_pod_owner{{{owner_selector(namespace, name)}}})"
    restarts = (
        f"(increase(kube_pod_container_status_restarts_total{{{containers}}}[{w}])"
        f" * on (namespace, pod) group_left () {owned})"
    )
    oom_terminated = (
        f'kube_pod_container_status_last_terminated_reason{{{containers},reason="OOMKilled"}} == 1'
    )
    return {
        "pods": f"count(vllm:num_requests_running{{{sel}}})",
        "kv_cache_usage": f"avg(avg_over_time(vllm:kv_cache_usage_perc{{{sel}}}[{w}]))",
        "requests_waiting": f"sum(avg_over_time(vllm:num_requests_waiting{{{sel}}}[{w}]))",
        "requests_running": f"sum(avg_over_time(vllm:num_requests_running{{{sel}}}[{w}]))",
        "preemptions_per_s": f"sum(rate(vllm:num_preemptions_total{{{sel}}}[{w}]))",
        "generation_tokens_per_s": f"sum(rate(vllm:generation_tokens_total{{{sel}}}[{w}]))",
        "prompt_tokens_per_s": f"sum(rate(vllm:prompt_tokens_total{{{sel}}}[{w}]))",
        "requests_per_s": (
            f'sum(rate(vllm:request_success_total{{{sel},finished_reason!="abort"}}[{w}]))'
        ),
        "aborted_per_s": (
            f'sum(rate(vllm:request_success_total{{{sel},finished_reason="abort"}}[{w}]))'
        ),
        # delta() of a gauge: its last value minus its first in the window.
        "queue_growth_per_s": (
            f"sum(delta(vllm:num_requests_waiting{{{sel}}}[{w}])) / {max(1, math.ceil(window_s))}"
        ),
        "ttft_p95_s": p95("vllm:time_to_first_token_seconds"),
        "itl_p95_s": p95("vllm:inter_token_latency_seconds"),
        "restarts": f"sum({restarts})",
        # Restarts of containers whose last termination was an OOM kill; 0 (not "no data")
        # when kube-state-metrics is there and nothing was killed.
        "oom_kills": (
            f"sum(({restarts} > 0) and on (namespace, pod, container) ({oom_terminated}))"
            f" or (0 * sum({restarts}))"
        ),
    }


def live_settings_query(namespace: str, name: str) -> str:
    return f"{INFO_METRIC}{{{engine_selector(namespace, name)}}}"


@dataclass
class Observation:
    """A Snapshot, or why there is none; and the live settings each engine reports."""

    snapshot: Snapshot | None
    problem: str = ""
    reason: str = ""  # condition reason when snapshot is None
    live: list[dict[str, str]] = field(default_factory=list)


def parse_scalar(result: list[dict[str, Any]]) -> float | None:
    """The value of a one-element instant vector; None when empty or NaN."""
    if not result:
        return None
    value = float(result[0]["value"][1])
    return None if math.isnan(value) else value


def snapshot_from_results(
    results: dict[str, list[dict[str, Any]]], window_s: float
) -> tuple[Snapshot | None, str]:
    """The Snapshot, or None and the names of the engine series Prometheus does not have."""
    values = {key: parse_scalar(result) for key, result in results.items()}
    # A histogram with no observations in the window answers NaN: that is "no request
    # finished", not a missing series. Only an empty answer means the series is absent.
    missing = [
        key
        for key in REQUIRED
        if not results.get(key) or (values[key] is None and not key.endswith("_p95_s"))
    ]
    if values.get("pods") in (None, 0.0) and "pods" not in missing:
        missing.append("pods")
    if missing:
        return None, ", ".join(missing)
    snapshot = Snapshot(
        window_s=window_s,
        pods=int(values["pods"] or 0),
        kv_cache_usage=values["kv_cache_usage"] or 0.0,
        requests_waiting=values["requests_waiting"] or 0.0,
        requests_running=values["requests_running"] or 0.0,
        preemptions_per_s=values["preemptions_per_s"] or 0.0,
        ttft_p95_s=values["ttft_p95_s"],
        itl_p95_s=values["itl_p95_s"],
        generation_tokens_per_s=values["generation_tokens_per_s"] or 0.0,
        requests_per_s=values["requests_per_s"] or 0.0,
        aborted_per_s=values["aborted_per_s"] or 0.0,
        queue_growth_per_s=values["queue_growth_per_s"] or 0.0,
        prompt_tokens_per_s=values["prompt_tokens_per_s"] or 0.0,
        restarts=values.get("restarts"),
        oom_kills=values.get("oom_kills"),
    )
    return snapshot, ""


@dataclass(frozen=True)
class PrometheusEndpoint:
    """Where the tuner asks, and how it proves who it is: a bearer token and a CA bundle
    (PEM) for managed Prometheus services and authenticating proxies."""

    url: str
    bearer_token: str | None = None
    ca_pem: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.bearer_token}"} if self.bearer_token else {}

    def ssl_context(self) -> ssl.SSLContext | None:
        """The CA bundle to trust, else the system's (None)."""
        return ssl.create_default_context(cadata=self.ca_pem) if self.ca_pem else None


class PrometheusError(Exception):
    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


async def instant_query(session: aiohttp.ClientSession, base_url: str, promql: str) -> list[dict]:
    url = base_url.rstrip("/") + "/api/v1/query"
    try:
        async with session.get(url, params={"query": promql}) as response:
            text = await response.text()
    except (TimeoutError, aiohttp.ClientError) as error:
        raise PrometheusError(f"{type(error).__name__}: {error}") from error
    try:
        body = json.loads(text)
    except ValueError:
        body = {"error": text[:200]}
    if response.status >= 400 or body.get("status") != "success":
        message = f"HTTP {response.status}: {body.get('error') or body}"
        raise PrometheusError(message, response.status)
    return list(body["data"]["result"])


async def observe(
    endpoint: PrometheusEndpoint, namespace: str, name: str, window_s: float
) -> Observation:
    """One window of metrics for one LLMDeployment; never raises for Prometheus trouble."""
    queries = snapshot_queries(namespace, name, window_s)
    queries["live"] = live_settings_query(namespace, name)
    timeout = aiohttp.ClientTimeout(total=QUERY_TIMEOUT_SECONDS)
    try:
        connector = aiohttp.TCPConnector(ssl=endpoint.ssl_context() or True)
    except (ssl.SSLError, ValueError) as error:
        problem = f"the CA bundle for {endpoint.url} is not a valid PEM bundle: {error}"
        return Observation(None, problem, "CredentialsInvalid")
    try:
        async with aiohttp.ClientSession(
            timeout=timeout, headers=endpoint.headers(), connector=connector
        ) as session:
            answers = await asyncio.gather(
                *(instant_query(session, endpoint.url, promql) for promql in queries.values())
            )
    except PrometheusError as error:
        if error.status in (401, 403):
            problem = f"Prometheus at {endpoint.url} refused the credentials: {error}"
            return Observation(None, problem, "Unauthorized")
        problem = f"Prometheus at {endpoint.url} unreachable: {error}"
        return Observation(None, problem, "Unreachable")
    results = dict(zip(queries, answers))
    live = [dict(item["metric"]) for item in results.pop("live")]
    snapshot, missing = snapshot_from_results(results, window_s)
    if snapshot is None:
        problem = f"no series for {missing} with {{{engine_selector(namespace, name)}}}"
        return Observation(None, problem, "SeriesMissing", live)
    return Observation(snapshot, live=live)
