"""Whether the engines' series reach Prometheus, and if not, the likely reason: the
MetricsScraped condition. Pure; ``observe.metrics_finding`` does the I/O.

A stock kube-prometheus-stack selects ServiceMonitors by its ``release`` label: a
ServiceMonitor without it is ignored without a word, KEDA then reads 0 and never scales and
the tuner reports SeriesMissing. This says why, once the engines have been Ready for a
while (``METRICS_GRACE_SECONDS``: a few scrape intervals).
"""

from __future__ import annotations

import datetime
import os
from typing import Any

from pagoda_operator.promql import engine_selector

METRICS_SCRAPED = "MetricsScraped"
GRACE_ENV = "PAGODA_METRICS_GRACE_SECONDS"
DEFAULT_GRACE_SECONDS = 300.0


def grace_seconds() -> float:
    return float(os.environ.get(GRACE_ENV) or DEFAULT_GRACE_SECONDS)


def series_query(namespace: str, name: str) -> str:
    """What the tuner counts engines by (``tuning.prometheus.snapshot_queries``' ``pods``)."""
    return f"count(vllm:num_requests_running{{{engine_selector(namespace, name)}}})"


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """Whether a metav1.LabelSelector selects ``labels``. The Prometheus Operator reads a
    null serviceMonitorSelector as "select none" and an empty one as "select all"."""
    if selector is None:
        return False
    if any(labels.get(key) != value for key, value in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression.get("key"), expression.get("operator")
        values = expression.get("values") or []
        present = key in labels
        if operator == "In" and not (present and labels[key] in values):
            return False
        if operator == "NotIn" and present and labels[key] in values:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


def _watches_namespace(prometheus: dict[str, Any], namespace: str) -> bool | None:
    """True/False when it can be told from the Prometheus object alone, else None (a
    namespace selector by labels: the namespace's labels are not read)."""
    selector = (prometheus.get("spec") or {}).get("serviceMonitorNamespaceSelector")
    if selector is None:  # only its own namespace
        return (prometheus.get("metadata") or {}).get("namespace") == namespace
    return True if selector == {} else None


def unscraped_cause(
    *,
    service_monitor_api: bool,
    operator_monitors: bool,
    monitor_labels: dict[str, str],
    namespace: str,
    prometheuses: list[dict[str, Any]] | None,
) -> str:
    """The likely reason no series arrived. ``prometheuses``: the Prometheus objects of the
    Prometheus Operator (None when they could not be listed)."""
    if not operator_monitors:
        return (
            "the operator's chart scrapes the engines with its own ServiceMonitor "
            "(serviceMonitor.enabled): check that your Prometheus selects it "
            "(serviceMonitor.labels, e.g. release: <your kube-prometheus-stack release>)"
        )
    if not service_monitor_api:
        return (
            "no Prometheus Operator in this cluster (monitoring.coreos.com/v1 ServiceMonitors "
            "are not served), so no ServiceMonitor was created: your Prometheus must scrape the "
            "pods through their prometheus.io/* annotations with the relabelling in "
            "operator/README.md (Label contract), or install the Prometheus Operator"
        )
    shown = ", ".join(f"{k}={v}" for k, v in sorted(monitor_labels.items()))
    if prometheuses is None:
        return f"check that your Prometheus selects the ServiceMonitor (labels {shown})"
    if not prometheuses:
        return "the Prometheus Operator runs no Prometheus (no Prometheus objects found)"
    selecting = [
        p
        for p in prometheuses
        if selects((p.get("spec") or {}).get("serviceMonitorSelector"), monitor_labels)
    ]
    if not selecting:
        wanted = "; ".join(
            f"{_name(p)} selects {(p.get('spec') or {}).get('serviceMonitorSelector')}"
            for p in prometheuses[:3]
        )
        return (
            f"no Prometheus selects the ServiceMonitor (labels {shown}): {wanted}. Set "
            "spec.monitoring.serviceMonitorLabels (or the chart's serviceMonitor.labels) to "
            "match, e.g. release: <your kube-prometheus-stack release>"
        )
    if all(_watches_namespace(p, namespace) is False for p in selecting):
        names = ", ".join(_name(p) for p in selecting)
        return (
            f"{names} select the ServiceMonitor's labels but not namespace {namespace} "
            "(serviceMonitorNamespaceSelector)"
        )
    names = ", ".join(_name(p) for p in selecting)
    return f"{names} select the ServiceMonitor: check their targets page for scrape errors"


def _name(prometheus: dict[str, Any]) -> str:
    meta = prometheus.get("metadata") or {}
    return f"Prometheus {meta.get('namespace')}/{meta.get('name')}"


def scraped_condition(engines: int | None, url: str, query: str, cause: str) -> dict[str, str]:
    """MetricsScraped: True with the engines reporting, else False with the cause."""
    if engines:
        return _condition(True, "SeriesFound", f"{engines} engines' series in Prometheus at {url}")
    return _condition(False, "SeriesMissing", f"{query} is empty at {url}: {cause}")


def unreachable_condition(url: str, problem: str) -> dict[str, str]:
    return _condition(False, "Unreachable", f"Prometheus at {url}: {problem}")


def _condition(is_true: bool, reason: str, message: str) -> dict[str, str]:
    status = "True" if is_true else "False"
    return {"type": METRICS_SCRAPED, "status": status, "reason": reason, "message": message}


def due(llmd: dict[str, Any], now: str) -> bool:
    """Whether to look now: a Prometheus is named, the engines have been Available for the
    grace, and no look has found the series yet."""
    spec, status = llmd.get("spec") or {}, llmd.get("status") or {}
    if not (spec.get("prometheus") or {}).get("url"):
        return False
    by_type = {cond.get("type"): cond for cond in status.get("conditions") or []}
    if (by_type.get(METRICS_SCRAPED) or {}).get("status") == "True":
        return False
    available = by_type.get("Available") or {}
    if available.get("status") != "True" or not available.get("lastTransitionTime"):
        return False
    return _seconds_between(available["lastTransitionTime"], now) >= grace_seconds()


def _seconds_between(earlier: str, later: str) -> float:
    parse = datetime.datetime.fromisoformat
    return (
        parse(later.replace("Z", "+00:00")) - parse(earlier.replace("Z", "+00:00"))
    ).total_seconds()
