"""Why pods and cache claims do not get going, as pure functions of what the scheduler,
the kubelet and the volume controllers write (field names as in core/v1 PodStatus and
Event), and what the status makes of it."""

from __future__ import annotations

from typing import Any

from pagoda_operator import constants as c
from pagoda_operator.diagnosis import Findings, claim_pending, pod_problem
from pagoda_operator.model_cache import CacheState
from pagoda_operator.status import workload_status

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
