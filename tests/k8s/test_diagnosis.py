"""Why pods and cache claims do not get going, as pure functions of what the scheduler,
the kubelet and the volume controllers write (field names as in core/v1 PodStatus and
Event), and what the status makes of it."""

from __future__ import annotations

from typing import Any

from pagoda_operator import constants as c
from pagoda_operator.desired import MonitorSettings, desired_service_monitor
from pagoda_operator.diagnosis import Findings, claim_pending, pod_problem
from pagoda_operator.metrics import due, scraped_condition, selects, series_query, unscraped_cause
from pagoda_operator.model_cache import CacheState
from pagoda_operator.status import needs_recheck, workload_status

NOW = "2025-01-01T01:00:00Z"
LONG_AGO = "2025-01-01T00:00:00Z"
JUST_NOW = "2025-01-01T00:59:50Z"


def pod(name: str = "qwen-7d9f-abcde", **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "creationTimestamp": LONG_AGO},
        "status": {"phase": "Pending", **status},
    }


def unscheduled(message: str, since: str = LONG_AGO) -> dict[str, Any]:
    scheduled = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": message,
        "lastTransitionTime": since,
    }
    return pod(conditions=[scheduled])


def event(kind: str, name: str, reason: str, message: str, kind_type: str = "Warning") -> dict:
    return {
        "type": kind_type,
        "reason": reason,
        "message": message,
        "involvedObject": {"kind": kind, "name": name},
        "lastTimestamp": LONG_AGO,
    }


def test_an_unschedulable_pod_says_the_schedulers_message() -> None:
    message = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    assert pod_problem([unscheduled(message)], [], NOW) == (
        "Unschedulable",
        f"pod qwen-7d9f-abcde: {message}",
    )
    # A node being added by a cluster autoscaler takes a moment: not a problem yet.
    assert pod_problem([unscheduled(message, since=JUST_NOW)], [], NOW) is None


def test_a_missing_claim_is_named() -> None:
    message = '0/3 nodes are available: persistentvolumeclaim "weights" not found.'
    reason, said = pod_problem([unscheduled(message)], [], NOW) or ("", "")
    assert reason == "PVCNotFound" and '"weights" not found' in said


def test_image_pull_and_crash_loop_say_the_kubelets_message() -> None:
    waiting = {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "x:1"'}
    pulling = pod(containerStatuses=[{"name": "engine", "state": {"waiting": waiting}}])
    assert pod_problem([pulling], [], NOW) == (
        "ImagePullBackOff",
        'pod qwen-7d9f-abcde: container engine: Back-off pulling image "x:1"',
    )
    crashing = pod(
        phase="Running",
        containerStatuses=[
            {
                "name": "engine",
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 5m0s"}},
                "lastState": {
                    "terminated": {"exitCode": 1, "reason": "Error", "message": "CUDA OOM\n"}
                },
            }
        ],
    )
    reason, message = pod_problem([crashing], [], NOW) or ("", "")
    assert reason == "CrashLoopBackOff"
    assert "last exit code 1 (Error): CUDA OOM" in message


def test_a_volume_that_cannot_attach_is_said_from_the_events() -> None:
    creating = pod(
        containerStatuses=[
            {"name": "engine", "state": {"waiting": {"reason": "ContainerCreating"}}}
        ]
    )
    multi_attach = event(
        "Pod",
        "qwen-7d9f-abcde",
        "FailedAttachVolume",
        'Multi-Attach error for volume "pvc-1" Volume is already used by pod(s) qwen-x',
    )
    other = event("Pod", "another-pod", "FailedMount", "not ours")
    assert pod_problem([creating], [other], NOW) is None
    reason, message = pod_problem([creating], [other, multi_attach], NOW) or ("", "")
    assert reason == "FailedAttachVolume" and "Multi-Attach" in message


def test_healthy_and_finished_pods_are_no_problem() -> None:
    running = pod(phase="Running", containerStatuses=[{"name": "engine", "state": {"running": {}}}])
    gone = unscheduled("0/3 nodes")
    gone["metadata"]["deletionTimestamp"] = NOW
    assert pod_problem([running, gone], [], NOW) is None


def claim(phase: str = "Pending", created: str = LONG_AGO) -> dict[str, Any]:
    return {
        "metadata": {"name": "qwen-model-cache", "namespace": "ml", "creationTimestamp": created},
        "spec": {"accessModes": ["ReadWriteMany"]},
        "status": {"phase": phase},
    }


def test_a_pending_claim_says_what_its_events_say() -> None:
    said = "no persistent volumes available for this claim and no storage class is set"
    events = [event("PersistentVolumeClaim", "qwen-model-cache", "FailedBinding", said, "Normal")]
    reason, message = claim_pending(claim(), events, NOW) or ("", "")
    assert reason == "PVCPending"
    assert said in message and "no storage class" in message
    assert claim_pending(claim("Bound"), events, NOW) is None
    assert claim_pending(claim(created=JUST_NOW), events, NOW) is None


def llmd(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "metadata": {"name": "qwen", "namespace": "ml", "uid": "u", "generation": 1},
        "spec": {"model": {"name": "m", "source": {"uri": "hf://o/m"}}, **spec},
    }


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {cond["type"]: cond for cond in status["conditions"]}


def test_the_status_says_the_claim_is_pending_instead_of_downloading() -> None:
    loading = CacheState(False, False, "Downloading", "Downloading the model")
    pending = ("PVCPending", "claim qwen-model-cache is Pending: waiting for first consumer")
    status = workload_status(
        llmd(), None, NOW, cache=loading, findings=Findings(claim_pending=pending)
    )
    cached = conditions(status)["ModelCached"]
    assert (cached["status"], cached["reason"]) == ("False", "PVCPending")
    assert "waiting for first consumer" in cached["message"]
    assert "waiting for first consumer" in conditions(status)["Progressing"]["message"]


def test_a_pod_problem_degrades_at_once_with_its_reason() -> None:
    deployment = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1}}
    problem = ("Unschedulable", "pod q-1: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu")
    status = workload_status(llmd(replicas=1), deployment, NOW, findings=Findings(pods=problem))
    assert status["phase"] == "Degraded"
    degraded = conditions(status)["Degraded"]
    assert (degraded["reason"], degraded["message"]) == problem


# --- metrics that never reach Prometheus -----------------------------------------------------

STACK = {
    "metadata": {"name": "kube-prometheus-stack-prometheus", "namespace": "monitoring"},
    "spec": {
        "serviceMonitorSelector": {"matchLabels": {"release": "kube-prometheus-stack"}},
        "serviceMonitorNamespaceSelector": {},
    },
}


def cause(labels: dict[str, str], prometheuses: list[dict[str, Any]] | None, **kw: Any) -> str:
    settings = {"service_monitor_api": True, "operator_monitors": True, **kw}
    return unscraped_cause(
        monitor_labels=labels, namespace="ml", prometheuses=prometheuses, **settings
    )


def test_a_service_monitor_the_stack_does_not_select_is_named() -> None:
    said = cause({"app.kubernetes.io/name": "pagoda-engine"}, [STACK])
    assert "no Prometheus selects the ServiceMonitor" in said
    assert "release" in said and "spec.monitoring.serviceMonitorLabels" in said
    selected = cause({"release": "kube-prometheus-stack"}, [STACK])
    assert "targets page" in selected


def test_other_causes() -> None:
    assert "no Prometheus Operator" in cause({}, None, service_monitor_api=False)
    assert "serviceMonitor.enabled" in cause({}, None, operator_monitors=False)
    own_namespace_only = {
        "metadata": {"name": "p", "namespace": "monitoring"},
        "spec": {"serviceMonitorSelector": {}},
    }
    assert "not namespace ml" in cause({"a": "b"}, [own_namespace_only])
    # A null selector selects no ServiceMonitor at all (the Prometheus Operator's reading).
    assert not selects(None, {"a": "b"}) and selects({}, {"a": "b"})
    expression = {"matchExpressions": [{"key": "team", "operator": "In", "values": ["ml"]}]}
    assert selects(expression, {"team": "ml"}) and not selects(expression, {})


def test_the_condition_and_when_to_look() -> None:
    query = series_query("ml", "qwen")
    assert query.startswith("count(vllm:num_requests_running{")
    missing = scraped_condition(0, "http://p:9090", query, "because")
    assert (missing["type"], missing["status"], missing["reason"]) == (
        "MetricsScraped",
        "False",
        "SeriesMissing",
    )
    assert scraped_condition(2, "http://p:9090", query, "")["status"] == "True"
    available = {"type": "Available", "status": "True", "lastTransitionTime": LONG_AGO}
    obj = llmd(prometheus={"url": "http://p:9090"})
    obj["status"] = {"phase": "Available", "conditions": [available]}
    assert due(obj, NOW) and needs_recheck(obj)
    assert not due(
        {**obj, "status": {"conditions": [{**available, "lastTransitionTime": JUST_NOW}]}}, NOW
    )
    obj["status"]["conditions"].append(missing | {"status": "True"})
    assert not due(obj, NOW) and not needs_recheck(obj)
    assert needs_recheck({**obj, "status": {"phase": "Pending"}})


def test_service_monitor_labels_per_llmdeployment() -> None:
    obj = llmd(monitoring={"serviceMonitorLabels": {"release": "kps", c.LABEL_OWNER: "x"}})
    monitor = desired_service_monitor(obj, MonitorSettings(labels={"team": "ml"}))
    labels = monitor["metadata"]["labels"]
    assert labels["release"] == "kps" and labels["team"] == "ml"
    assert labels[c.LABEL_OWNER] == "qwen"  # the operator's own labels win
