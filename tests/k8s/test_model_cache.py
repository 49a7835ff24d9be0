"""Model delivery for hf:// and s3:// sources, as pure functions: the cache volume, the loader
Job, the cache's state from the Job and its pods, and what the status says about it."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest
from pagoda_operator import constants as c
from pagoda_operator.desired import desired_objects
from pagoda_operator.engine_args import serve_args
from pagoda_operator.model_cache import cache_folder, cache_state
from pagoda_operator.plan import object_key, plan_actions
from pagoda_operator.spec import validate_spec, with_defaults
from pagoda_operator.status import model_cache_event, workload_status
from pagoda_operator.storage import settle_claim

from .test_manifests import KUBERNETES_VERSIONS

NOW = "2025-01-01T00:00:00Z"
HF_SOURCE = {"uri": "hf://Qwen/Qwen2.5-7B-Instruct@v1", "credentialsSecret": {"name": "hf"}}


def llmd(source: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "metadata": {"name": "qwen", "namespace": "ml", "uid": "uid-1", "generation": 1},
        "spec": {
            "model": {"name": "Qwen/Qwen2.5-7B-Instruct", "source": source or HF_SOURCE},
            **spec,
        },
    }


def objects(obj: dict[str, Any], **kwargs: Any) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in desired_objects(obj, service_monitor_api=False, **kwargs)}


def job_with(obj: dict[str, Any], *conditions: tuple[str, str], **status: Any) -> dict[str, Any]:
    job = objects(obj)["Job"]
    job["status"] = {
        **status,
        "conditions": [{"type": t, "status": "True", "reason": r} for t, r in conditions],
    }
    return job


def pod(phase: str, message: str = "", waiting: dict[str, str] | None = None) -> dict[str, Any]:
    state = {"waiting": waiting} if waiting else {"terminated": {"message": message}}
    return {
        "metadata": {"creationTimestamp": NOW},
        "status": {"phase": phase, "containerStatuses": [{"name": "loader", "state": state}]},
    }


def job_hash(obj: dict[str, Any]) -> str:
    return objects(obj)["Job"]["metadata"]["annotations"][c.ANNOTATION_CONFIG_HASH]


def test_download_source_owns_a_cache_and_a_loader_job() -> None:
    owned = objects(llmd(replicas=2))
    assert list(owned) == [
        "PersistentVolumeClaim",
        "Job",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
    ]
    claim = owned["PersistentVolumeClaim"]
    assert claim["metadata"]["name"] == "qwen-model-cache"
    # Two replicas may land on two nodes: the volume must be shareable.
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "100Gi"}},
    }
    job = owned["Job"]
    assert job["metadata"]["name"] == "qwen-model-loader"
    pod_spec = job["spec"]["template"]["spec"]
    (container,) = pod_spec["containers"]
    folder = cache_folder(with_defaults(llmd()["spec"]))
    # The loader makes the engines' kernel cache beside the model folders, then downloads.
    assert container["command"] == ["/bin/sh", "-c", 'mkdir -p -m 1777 "$0" && exec pagoda "$@"']
    assert container["args"] == [
        "/cache/.kernel-cache",
        "download", "hf://Qwen/Qwen2.5-7B-Instruct@v1", f"/cache/{folder}",
        "--result-file", "/dev/termination-log",
    ]  # fmt: skip
    # The token reaches the loader from the Secret, never through the spec.
    assert container["envFrom"] == [{"secretRef": {"name": "hf"}}]
    assert "hf_" not in json.dumps(job)
    assert pod_spec["restartPolicy"] == "Never"
    assert pod_spec["securityContext"]["runAsNonRoot"] is True
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert rules[0]["action"] == "FailJob"
    assert rules[0]["onExitCodes"]["values"] == [2, 3, 4, 6]  # bad URI, auth, not found, verify

    deployment = owned["Deployment"]
    engine = deployment["spec"]["template"]["spec"]
    assert {
        "name": "model", "persistentVolumeClaim": {"claimName": "qwen-model-cache"},
    } in engine["volumes"]  # fmt: skip
    mounts = engine["containers"][0]["volumeMounts"]
    # The weights read-only; compiled kernels persist across restarts beside them.
    assert {"name": "model", "mountPath": "/models", "readOnly": True, "subPath": folder} in mounts
    assert {"name": "model", "mountPath": "/home/pagoda/.cache/triton",
            "subPath": ".kernel-cache"} in mounts  # fmt: skip
    assert serve_args(with_defaults(llmd()["spec"]))[1] == "/models"


def test_replicas_wait_for_the_cache() -> None:
    assert objects(llmd(replicas=3), model_cached=False)["Deployment"]["spec"]["replicas"] == 0
    assert objects(llmd(replicas=3))["Deployment"]["spec"]["replicas"] == 3


def tuned(replicas: int, maxReplicas: int, override: int) -> dict[str, Any]:
    """Tuning Auto with the tuner's replica override recorded in the status."""
    obj = llmd(
        replicas=replicas,
        tuning={"mode": "Auto"},
        autoscaling={"minReplicas": 1, "maxReplicas": maxReplicas},
        prometheus={"url": "http://prometheus:9090"},
    )
    obj["status"] = {
        "tuning": {"overrides": {"replicas": {"value": override, "specValue": replicas}}}
    }
    return obj


def test_the_cache_gate_wins_over_a_replica_override() -> None:
    obj = tuned(replicas=1, maxReplicas=4, override=3)
    assert objects(obj)["Deployment"]["spec"]["replicas"] == 3
    assert objects(obj, model_cached=False)["Deployment"]["spec"]["replicas"] == 0
    status = workload_status(obj, None, NOW)
    assert status["effective"]["replicas"] == 3


def test_a_replica_override_never_changes_the_cache_access_mode() -> None:
    # Access modes of a claim cannot change: the tuner's range decides, not its current value.
    def mode(obj: dict[str, Any]) -> str:
        return objects(obj)["PersistentVolumeClaim"]["spec"]["accessModes"][0]

    assert mode(tuned(replicas=1, maxReplicas=4, override=1)) == "ReadWriteMany"
    assert mode(tuned(replicas=1, maxReplicas=4, override=3)) == "ReadWriteMany"
    assert mode(tuned(replicas=1, maxReplicas=1, override=1)) == "ReadWriteOnce"
    pinned = tuned(replicas=1, maxReplicas=4, override=3)
    pinned["spec"]["tuning"]["pinned"] = ["replicas"]
    assert mode(pinned) == "ReadWriteOnce"
    assert mode(llmd(replicas=1)) == "ReadWriteOnce"


def test_cache_settings_and_s3_endpoint() -> None:
    source = {
        "uri": "s3://models/llama",
        "endpoint": "http://minio.minio:9000",
        "credentialsSecret": {"name": "store"},
    }
    cache = {"size": "40Gi", "storageClassName": "fast", "accessMode": "ReadWriteOncePod"}
    owned = objects(llmd(source, model={"name": "l", "source": source, "cache": cache}))
    assert owned["PersistentVolumeClaim"]["spec"] == {
        "accessModes": ["ReadWriteOncePod"],
        "resources": {"requests": {"storage": "40Gi"}},
        "storageClassName": "fast",
    }
    args = owned["Job"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-2:] == ["--endpoint-url", "http://minio.minio:9000"]


def test_each_source_gets_its_own_folder() -> None:
    def folder(uri: str, endpoint: str | None = None) -> str:
        source = {"uri": uri, **({"endpoint": endpoint} if endpoint else {})}
        return cache_folder({"model": {"source": source}})

    assert folder("hf://Qwen/Qwen2.5-7B@v1").startswith("Qwen_Qwen2.5-7B_v1-")
    assert folder("hf://Qwen/Qwen2.5-7B@v1") != folder("hf://Qwen/Qwen2.5-7B@v2")
    assert folder("s3://b/m") != folder("s3://b/m", "http://minio:9000")


def test_pvc_uri_is_mounted_without_a_loader() -> None:
    owned = objects(llmd({"uri": "pvc://weights/qwen/7b"}))
    assert "Job" not in owned and "PersistentVolumeClaim" not in owned
    pod_spec = owned["Deployment"]["spec"]["template"]["spec"]
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "weights", "readOnly": True},
    } in pod_spec["volumes"]
    assert pod_spec["containers"][0]["volumeMounts"][-1]["subPath"] == "qwen/7b"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ({"uri": "gs://b/m"}, "must start with hf://, s3:// or pvc://"),
        ({"uri": "hf://no-org"}, "expected hf://ORG/NAME"),
        ({"uri": "pvc://w/m", "credentialsSecret": {"name": "x"}}, "go with an hf:// or s3://"),
        ({"uri": "s3://b", "pvc": {"claimName": "w"}}, "set only one of"),
    ],
)
def test_operator_refuses_bad_sources(source: dict[str, Any], expected: str) -> None:
    errors = validate_spec(with_defaults(llmd(source)["spec"]))
    assert any(expected in error for error in errors), errors


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_cache_objects_validate_for_kubernetes(version: str) -> None:
    for obj in desired_objects(llmd(replicas=2), service_monitor_api=False):
        kubernetes_validate.validate(obj, version, strict=True)


# --- the cache's state ----------------------------------------------------------------------


def test_state_while_the_job_is_missing_or_running() -> None:
    obj = llmd()
    assert cache_state(None, [], job_hash(obj)).reason == "LoaderStarting"
    state = cache_state(job_with(obj, active=1), [], job_hash(obj))
    assert (state.ready, state.failed, state.reason) == (False, False, "Downloading")
    retried = cache_state(
        job_with(obj, failed=1),
        [pod("Failed", json.dumps({"error": "Unreachable", "message": "hub unreachable"}))],
        job_hash(obj),
    )
    assert "attempt 2" in retried.message and "hub unreachable" in retried.message


def test_a_job_for_another_source_is_not_the_cache() -> None:
    done = job_with(llmd(), ("Complete", ""), succeeded=1)
    newer = llmd({"uri": "hf://Qwen/Qwen2.5-7B-Instruct@v2"})
    assert not cache_state(done, [], job_hash(newer)).ready


def test_success_reports_revision_and_bytes() -> None:
    obj = llmd()
    result = {"uri": "hf://...", "revision": "a" * 40, "bytes": 15_000_000_000, "files": 9}
    state = cache_state(
        job_with(obj, ("Complete", ""), succeeded=1),
        [pod("Succeeded", json.dumps(result))],
        job_hash(obj),
    )
    assert state.ready and state.revision == "a" * 40 and state.num_bytes == 15_000_000_000
    status = workload_status(obj, None, NOW, cache=state)
    assert status["modelCache"]["state"] == "Ready"
    assert status["modelCache"]["revision"] == "a" * 40
    cached = next(cond for cond in status["conditions"] if cond["type"] == "ModelCached")
    assert cached["status"] == "True"


def test_wrong_token_is_a_clear_condition_not_a_crash_loop() -> None:
    obj = llmd()
    failure = {"error": "AuthFailed", "message": "hf://Qwen/...: the hub refused the credentials"}
    state = cache_state(
        job_with(obj, ("Failed", "PodFailurePolicy")),
        [pod("Failed", json.dumps(failure))],
        job_hash(obj),
    )
    assert state.failed and state.reason == "AuthFailed"
    status = workload_status(obj, objects(obj, model_cached=False)["Deployment"], NOW, cache=state)
    assert status["phase"] == "Degraded"
    conditions = {cond["type"]: cond for cond in status["conditions"]}
    assert conditions["Degraded"]["reason"] == "AuthFailed"
    assert "refused the credentials" in conditions["Degraded"]["message"]
    assert conditions["ModelCached"]["status"] == "False"
    event = model_cache_event({}, status)
    assert event is not None and event[0] == "Warning" and event[1] == "ModelLoaderAuthFailed"


def test_a_missing_secret_shows_while_the_job_waits() -> None:
    obj = llmd()
    waiting = {"reason": "CreateContainerConfigError", "message": 'secret "hf" not found'}
    state = cache_state(job_with(obj, active=1), [pod("Pending", waiting=waiting)], job_hash(obj))
    assert state.reason == "CreateContainerConfigError" and "not found" in state.message
    status = workload_status(obj, objects(obj, model_cached=False)["Deployment"], NOW, cache=state)
    assert status["phase"] == "Pending"


def test_a_new_revision_keeps_the_serving_deployment_until_cached() -> None:
    """The plan for a source change updates the Job, and the reconciler holds the
    Deployment's update back until the new cache is ready (see reconcile.py)."""
    old, new = llmd(replicas=2), llmd({"uri": "hf://Qwen/Qwen2.5-7B-Instruct@v2"}, replicas=2)
    existing_objects = objects(old)
    for obj in existing_objects.values():
        obj["metadata"]["ownerReferences"][0]["uid"] = "uid-1"
    existing = {object_key(o): o for o in existing_objects.values()}
    actions = plan_actions(
        desired_objects(new, service_monitor_api=False, model_cached=False), existing, "uid-1"
    )
    verbs = {action.kind: action.verb for action in actions}
    assert verbs["Job"] == "replace"  # a Job's template cannot change in place
    assert verbs["Deployment"] == "update"  # dropped by the reconciler while loading


# --- the claim as it exists: immutable fields are decided once -----------------------------


def live_claim(
    mode: str, phase: str = "Bound", size: str = "100Gi", storage_class: str | None = None
) -> dict[str, Any]:
    spec: dict[str, Any] = {"accessModes": [mode], "resources": {"requests": {"storage": size}}}
    if storage_class:
        spec["storageClassName"] = storage_class
    return {"metadata": {"name": "qwen-model-cache"}, "spec": spec, "status": {"phase": phase}}


def test_a_replica_change_keeps_the_live_access_mode() -> None:
    # 1 -> 2 replicas once asked for ReadWriteMany; access modes cannot change (HTTP 422), so
    # the claim as created stays, and nothing says it is a problem: the user asked for none.
    spec = with_defaults(llmd(replicas=2)["spec"])
    desired = objects(llmd(replicas=2))["PersistentVolumeClaim"]
    settled = settle_claim(desired, live_claim("ReadWriteOnce"), spec)
    assert settled.claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert [reason for reason, _ in settled.problems] == ["ReadWriteOnceShared"]
    again = settle_claim(desired, live_claim("ReadWriteOnce"), spec)
    assert again.claim["metadata"]["annotations"] == settled.claim["metadata"]["annotations"]
    before = objects(llmd(replicas=1))["PersistentVolumeClaim"]
    first = settle_claim(before, live_claim("ReadWriteOnce"), with_defaults(llmd()["spec"]))
    # The same object as before the replica change: the plan has nothing to update.
    assert first.claim == settled.claim


def test_an_asked_change_of_an_immutable_field_is_a_problem_named_by_field() -> None:
    cache = {"accessMode": "ReadWriteMany", "storageClassName": "efs", "size": "50Gi"}
    obj = llmd(model={"name": "q", "source": HF_SOURCE, "cache": cache})
    desired = objects(obj)["PersistentVolumeClaim"]
    live = live_claim("ReadWriteOnce", storage_class="gp3")
    settled = settle_claim(desired, live, with_defaults(obj["spec"]))
    assert settled.claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert settled.claim["spec"]["storageClassName"] == "gp3"
    assert settled.claim["spec"]["resources"]["requests"]["storage"] == "100Gi"  # no shrinking
    assert {reason for reason, _ in settled.problems} == {"ImmutableField"}
    text = " ".join(message for _, message in settled.problems)
    for field in ("spec.model.cache.accessMode", "spec.model.cache.storageClassName"):
        assert field in text
    assert "spec.model.cache.size" in text and "delete the claim" in text


def test_a_read_write_once_cache_for_several_replicas_is_said() -> None:
    obj = llmd(replicas=3)
    desired = objects(obj)["PersistentVolumeClaim"]
    settled = settle_claim(desired, live_claim("ReadWriteOnce"), with_defaults(obj["spec"]))
    assert any("Multi-Attach" in message for _, message in settled.problems)
    # No claim yet: the spec's choice is made now (and only now).
    fresh = settle_claim(desired, None, with_defaults(obj["spec"]))
    assert fresh.claim["spec"]["accessModes"] == ["ReadWriteMany"] and fresh.problems == []


def test_the_loader_lands_where_the_engines_may_run() -> None:
    # A ReadWriteOnce volume is provisioned in the zone of its first consumer, the loader:
    # it must be a node the engines may use too, or they meet "volume node affinity conflict".
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "gpu", "operator": "In", "values": ["h200"]}]}]}}}  # fmt: skip
    owned = objects(llmd(affinity=affinity, nodeSelector={"pool": "gpu"}))
    loader = owned["Job"]["spec"]["template"]["spec"]
    assert loader["affinity"] == affinity and loader["nodeSelector"] == {"pool": "gpu"}
