"""A real `kopf run` of the operator against the kmock Kubernetes API emulator.

Every test drives the operator only through the API, as kubectl would, and asserts on the
objects and Events it leaves there.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import MANIFESTS, module_entry_command, operator_attached
from .emulated_cluster import TEST_USER_AGENT, EmulatedCluster, wait_for

GROUP_PATH = "/apis/pagoda.dev/v1alpha1"


def llmd_path(namespace: str, name: str = "") -> str:
    return f"{GROUP_PATH}/namespaces/{namespace}/llmdeployments" + (f"/{name}" if name else "")


def deployment_path(namespace: str, name: str) -> str:
    return f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}"


def service_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/services/{name}"


def pdb_path(namespace: str, name: str) -> str:
    return f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/{name}"


def make_llmd(namespace: str, name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "pagoda.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, **spec},
    }


def events(cluster: EmulatedCluster, namespace: str) -> list[dict[str, Any]]:
    return cluster.items(f"/api/v1/namespaces/{namespace}/events")


def event_messages(cluster: EmulatedCluster, namespace: str) -> list[str]:
    return [f"{e.get('reason')}: {e.get('message')}" for e in events(cluster, namespace)]


def llmd_status(cluster: EmulatedCluster, namespace: str, name: str) -> dict[str, Any]:
    return (cluster.get(llmd_path(namespace, name)) or {}).get("status") or {}


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def engine_container(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_apply_creates_deployment_and_service(cluster: EmulatedCluster) -> None:
    namespace, name = "create", "qwen"
    spec = {"engine": {"tensorParallelSize": 2, "maxNumSeqs": 128}}
    cluster.create(llmd_path(namespace), make_llmd(namespace, name, **spec))

    deployment = wait_for(lambda: cluster.get(deployment_path(namespace, name)), what="Deployment")
    container = engine_container(deployment)
    args = container["args"]
    assert container["command"] == ["pagoda"]
    assert args[:2] == ["serve", "default"]
    assert flag_value(args, "--tensor-parallel-size") == "2"
    assert flag_value(args, "--max-num-seqs") == "128"
    assert flag_value(args, "--gpu-memory-utilization") == "0.9"
    assert flag_value(args, "--served-model-name") == "Qwen/Qwen2.5-7B-Instruct"
    assert flag_value(args, "--port") == "8000"
    assert container["image"] == "registry.test/pagoda-engine:test"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["startupProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    pod = deployment["spec"]["template"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in pod["spec"][
        "volumes"
    ]
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"

    service = wait_for(lambda: cluster.get(service_path(namespace, name)), what="Service")
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    ]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    # One replica: no PodDisruptionBudget; no ServiceMonitor API: no ServiceMonitor.
    assert cluster.get(pdb_path(namespace, name)) is None

    status = wait_for(lambda: llmd_status(cluster, namespace, name).get("phase"), what="phase")
    assert status == "Progressing"
    messages = wait_for(
        lambda: [m for m in event_messages(cluster, namespace) if m.startswith("Created")],
        what="Created events",
    )
    assert any("Created Deployment qwen" in m for m in messages)
    wait_for(
        lambda: any("Created Service qwen" in m for m in event_messages(cluster, namespace)),
        what="Service event",
    )


def test_changing_max_num_seqs_rolls_the_deployment(cluster: EmulatedCluster) -> None:
    namespace, name = "update", "qwen"
    cluster.create(llmd_path(namespace), make_llmd(namespace, name))
    deployment = wait_for(lambda: cluster.get(deployment_path(namespace, name)), what="Deployment")
    assert flag_value(engine_container(deployment)["args"], "--max-num-seqs") == "1024"

    cluster.patch(llmd_path(namespace, name), {"spec": {"engine": {"maxNumSeqs": 64}}})

    def updated_args() -> list[str] | None:
        args = engine_container(cluster.get(deployment_path(namespace, name)) or {})["args"]
        return args if flag_value(args, "--max-num-seqs") == "64" else None

    args = wait_for(updated_args, what="--max-num-seqs 64")
    assert flag_value(args, "--tensor-parallel-size") == "1"
    wait_for(
        lambda: any(
            "Updated Deployment qwen: --max-num-seqs 1024 -> 64" in m
            for m in event_messages(cluster, namespace)
        ),
        what="the Updated event",
    )
    wait_for(
        lambda: llmd_status(cluster, namespace, name).get("observedGeneration") == 2,
        what="observedGeneration 2",
    )


def test_ready_replicas_make_it_available(cluster: EmulatedCluster) -> None:
    namespace, name = "ready", "qwen"
    cluster.create(llmd_path(namespace), make_llmd(namespace, name))
    deployment = wait_for(lambda: cluster.get(deployment_path(namespace, name)), what="Deployment")
    wait_for(lambda: llmd_status(cluster, namespace, name).get("phase") == "Progressing")

    ready = {
        "observedGeneration": deployment["metadata"]["generation"],
        "replicas": 1,
        "updatedReplicas": 1,
        "readyReplicas": 1,
        "availableReplicas": 1,
    }
    cluster.patch(deployment_path(namespace, name) + "/status", {"status": ready})

    status = wait_for(
        lambda: (s := llmd_status(cluster, namespace, name)).get("phase") == "Available" and s,
        what="phase Available",
    )
    assert status["readyReplicas"] == 1
    assert condition(status, "Available")["status"] == "True"
    assert condition(status, "Progressing")["status"] == "False"
    assert condition(status, "Degraded")["status"] == "False"
    wait_for(
        lambda: any(m.startswith("PhaseAvailable") for m in event_messages(cluster, namespace)),
        what="the phase Event",
    )


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        ({"maxNumSeqs": 0}, "spec.engine.maxNumSeqs: must be >= 1"),
        ({"extraArgs": ["--port=9000"]}, "--port is set by the operator"),
    ],
    ids=["schema-range", "managed-flag"],
)
def test_invalid_spec_is_degraded_without_retries(
    cluster: EmulatedCluster, engine: dict[str, Any], expected: str
) -> None:
    namespace, name = f"invalid-{len(expected)}", "broken"
    cluster.create(llmd_path(namespace), make_llmd(namespace, name, engine=engine))

    status = wait_for(
        lambda: (s := llmd_status(cluster, namespace, name)).get("phase") == "Degraded" and s,
        what="phase Degraded",
    )
    degraded = condition(status, "Degraded")
    assert degraded["status"] == "True"
    assert degraded["reason"] == "InvalidSpec"
    assert expected in degraded["message"]
    warnings = wait_for(
        lambda: [e for e in events(cluster, namespace) if e.get("type") == "Warning"],
        what="a Warning event",
    )
    assert expected in warnings[0]["message"]
    assert cluster.get(deployment_path(namespace, name)) is None

    # No retry storm: once Degraded, the operator leaves the object alone.
    settled = len(operator_calls(cluster, namespace))
    time.sleep(2.0)
    assert len(operator_calls(cluster, namespace)) == settled

    # Fixing the spec clears the verdict and deploys.
    cluster.patch(
        llmd_path(namespace, name), {"spec": {"engine": {"maxNumSeqs": 8, "extraArgs": []}}}
    )
    wait_for(lambda: cluster.get(deployment_path(namespace, name)), what="Deployment after fix")
    wait_for(
        lambda: (
            condition(llmd_status(cluster, namespace, name), "Degraded").get("status") == "False"
        ),
        what="Degraded=False after fix",
    )


def test_pdb_follows_the_replica_count(cluster: EmulatedCluster) -> None:
    namespace, name = "pdb", "qwen"
    cluster.create(llmd_path(namespace), make_llmd(namespace, name, replicas=2))
    pdb = wait_for(lambda: cluster.get(pdb_path(namespace, name)), what="PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1

    cluster.patch(llmd_path(namespace, name), {"spec": {"replicas": 1}})
    wait_for(lambda: cluster.get(pdb_path(namespace, name)) is None, what="PDB deleted")
    wait_for(
        lambda: (cluster.get(deployment_path(namespace, name)) or {})["spec"]["replicas"] == 1,
        what="Deployment scaled to 1",
    )
    assert any("Deleted PodDisruptionBudget qwen" in m for m in event_messages(cluster, namespace))


def test_delete_removes_what_it_owned(cluster: EmulatedCluster) -> None:
    namespace, name = "delete", "qwen"
    created = cluster.create(llmd_path(namespace), make_llmd(namespace, name, replicas=2))
    owned_paths = [
        deployment_path(namespace, name),
        service_path(namespace, name),
        pdb_path(namespace, name),
    ]
    owned = [wait_for(lambda p=path: cluster.get(p), what=path) for path in owned_paths]
    expected_reference = {
        "apiVersion": "pagoda.dev/v1alpha1",
        "kind": "LLMDeployment",
        "name": name,
        "uid": created["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    for obj in owned:
        assert obj["metadata"]["ownerReferences"] == [expected_reference]

    cluster.delete(llmd_path(namespace, name))
    for path in owned_paths:
        wait_for(lambda p=path: cluster.get(p) is None, what=f"{path} deleted")
    # No finalizer of ours held the object back.
    assert cluster.get(llmd_path(namespace, name)) is None


def test_tuned_object_gets_no_finalizer_and_deletes_at_once(cluster: EmulatedCluster) -> None:
    """Deleting a tuned LLMDeployment never waits for the operator (which may be uninstalled
    while the CRD, kept, still holds the object)."""
    namespace, name = "tuned", "qwen"
    tuning = {"mode": "Recommend"}
    prometheus = {"url": "http://127.0.0.1:9"}
    cluster.create(
        llmd_path(namespace), make_llmd(namespace, name, tuning=tuning, prometheus=prometheus)
    )
    wait_for(lambda: cluster.get(deployment_path(namespace, name)), what="Deployment")
    wait_for(lambda: llmd_status(cluster, namespace, name).get("phase"), what="a status")
    time.sleep(1.0)  # kopf adds a timer's finalizer when it first handles the object
    assert not (cluster.get(llmd_path(namespace, name)) or {})["metadata"].get("finalizers")
    cluster.delete(llmd_path(namespace, name))
    assert cluster.get(llmd_path(namespace, name)) is None


def test_service_monitor_once_its_crd_is_served(cluster: EmulatedCluster) -> None:
    cluster.serve_resource("monitoring.coreos.com/v1/servicemonitors", "ServiceMonitor")
    namespace, name = "monitored", "qwen"
    cluster.create(llmd_path(namespace), make_llmd(namespace, name))
    monitor = wait_for(
        lambda: cluster.get(
            f"/apis/monitoring.coreos.com/v1/namespaces/{namespace}/servicemonitors/{name}"
        ),
        what="ServiceMonitor",
    )
    assert monitor["spec"]["endpoints"][0]["port"] == "http"
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


def test_review_fixes_reach_the_cluster(cluster: EmulatedCluster) -> None:
    """pvc.readOnly, the rollout and termination defaults, pod template fields, Service
    annotations and per-condition observedGeneration, as the operator applies them."""
    namespace, name = "fixes", "qwen"
    model = {"name": "m", "source": {"pvc": {"claimName": "w", "readOnly": False}}}
    spec = {
        "model": model,
        "replicas": 2,
        "priorityClassName": "inference",
        "podLabels": {"team": "ml"},
        "service": {"annotations": {"example.com/lb": "internal"}},
    }
    cluster.create(llmd_path(namespace), make_llmd(namespace, name, **spec))
    deployment = wait_for(lambda: cluster.get(deployment_path(namespace, name)), what="Deployment")
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["labels"]["team"] == "ml"
    assert pod["spec"]["priorityClassName"] == "inference"
    assert pod["spec"]["terminationGracePeriodSeconds"] == 150
    container = engine_container(deployment)
    assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": 10}}}
    assert flag_value(container["args"], "--shutdown-grace-seconds") == "120"
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "model"]
    assert mount["readOnly"] is False
    service = wait_for(lambda: cluster.get(service_path(namespace, name)), what="Service")
    assert service["metadata"]["annotations"]["example.com/lb"] == "internal"
    status = wait_for(
        lambda: (s := llmd_status(cluster, namespace, name)).get("conditions") and s,
        what="conditions",
    )
    assert {cond["observedGeneration"] for cond in status["conditions"]} == {1}


def test_watches_only_its_own_objects(cluster: EmulatedCluster) -> None:
    """Owned kinds are watched with a server-side label selector, never cluster-wide."""

    def watched() -> dict[str, str | None]:
        return {
            path: query.get("labelSelector")
            for _, method, path, query in operator_calls(cluster)
            if method == "GET" and query.get("watch") == "true" and "pagoda.dev" not in path
        }

    expected = {
        "/apis/apps/v1/deployments",
        "/apis/batch/v1/jobs",
        "/api/v1/pods",
        "/api/v1/services",
        "/api/v1/persistentvolumeclaims",
    }
    wait_for(lambda: expected <= set(watched()), what="the owned kinds' watches")
    assert set(watched().values()) == {"app.kubernetes.io/managed-by=pagoda-operator"}


def test_hand_edits_and_deletions_are_undone(cluster: EmulatedCluster) -> None:
    namespace, name = "drift", "qwen"
    cluster.create(llmd_path(namespace), make_llmd(namespace, name))
    deployment = wait_for(lambda: cluster.get(deployment_path(namespace, name)), what="Deployment")
    wait_for(lambda: cluster.get(service_path(namespace, name)), what="Service")

    cluster.delete(service_path(namespace, name))
    wait_for(lambda: cluster.get(service_path(namespace, name)), what="Service restored")

    template = deployment["spec"]["template"]
    container = {
        **engine_container(deployment),
        "args": ["serve", "default", "--max-num-seqs", "1"],
    }
    edited = {
        "spec": {"template": {**template, "spec": {**template["spec"], "containers": [container]}}}
    }
    cluster.patch(deployment_path(namespace, name), edited)
    wait_for(
        lambda: (
            flag_value(
                engine_container(cluster.get(deployment_path(namespace, name)))["args"],
                "--max-num-seqs",
            )
            == "1024"
        ),
        what="the Deployment restored",
    )
    wait_for(
        lambda: any("restored spec.template" in m for m in event_messages(cluster, namespace)),
        what="an Updated event saying what was restored",
    )


def job_path(namespace: str, name: str) -> str:
    return f"/apis/batch/v1/namespaces/{namespace}/jobs/{name}-model-loader"


def claim_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{name}-model-cache"


def age_claim(cluster: EmulatedCluster, namespace: str, name: str) -> None:
    """Makes the cache claim look created long ago (and never bound: no volume controller
    runs here), as if the operator had watched it wait."""
    wait_for(lambda: cluster.get(claim_path(namespace, name)), what="cache claim")
    old = {"metadata": {"creationTimestamp": "2020-01-01T00:00:00Z"}}
    cluster.patch(claim_path(namespace, name), old)


def finish_loader(
    cluster: EmulatedCluster, namespace: str, name: str, *, result: dict[str, Any], ok: bool
) -> None:
    """What the Job controller and kubelet do when the loader pod exits: a pod with the
    downloader's termination message, and the Job's terminal condition."""
    job = cluster.get(job_path(namespace, name))
    assert job is not None
    labels = {
        **job["spec"]["template"]["metadata"]["labels"],
        "batch.kubernetes.io/job-name": job["metadata"]["name"],
    }
    terminated = {"exitCode": 0 if ok else 3, "message": json.dumps(result)}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{name}-model-loader-x1", "namespace": namespace, "labels": labels},
        "spec": job["spec"]["template"]["spec"],
        "status": {
            "phase": "Succeeded" if ok else "Failed",
            "containerStatuses": [{"name": "loader", "state": {"terminated": terminated}}],
        },
    }
    cluster.create(f"/api/v1/namespaces/{namespace}/pods", pod)
    kind = "Complete" if ok else "Failed"
    status = {
        "conditions": [{"type": kind, "status": "True", "reason": "PodFailurePolicy"}],
        **({"succeeded": 1} if ok else {"failed": 1}),
    }
    cluster.patch(job_path(namespace, name) + "/status", {"status": status})


HF_SOURCE = {"uri": "hf://Qwen/Qwen2.5-7B-Instruct@main", "credentialsSecret": {"name": "hf"}}


def test_downloaded_model_starts_replicas_once_cached(cluster: EmulatedCluster) -> None:
    namespace, name = "cache", "qwen"
    model = {"name": "Qwen/Qwen2.5-7B-Instruct", "source": HF_SOURCE}
    cluster.create(llmd_path(namespace), make_llmd(namespace, name, model=model, replicas=2))

    claim = wait_for(lambda: cluster.get(claim_path(namespace, name)), what="cache claim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    job = wait_for(lambda: cluster.get(job_path(namespace, name)), what="loader Job")
    loader = job["spec"]["template"]["spec"]["containers"][0]
    assert loader["args"][1:3] == ["download", HF_SOURCE["uri"]]
    assert loader["envFrom"] == [{"secretRef": {"name": "hf"}}]
    deployment = wait_for(lambda: cluster.get(deployment_path(namespace, name)), what="Deployment")
    assert deployment["spec"]["replicas"] == 0  # nothing to serve before the weights are there
    status = wait_for(
        lambda: (s := llmd_status(cluster, namespace, name)).get("modelCache") and s,
        what="modelCache status",
    )
    assert status["phase"] == "Pending"
    assert status["modelCache"]["state"] == "Loading"
    assert condition(status, "ModelCached")["status"] == "False"

    revision = "c" * 40
    finish_loader(
        cluster, namespace, name, ok=True,
        result={"uri": HF_SOURCE["uri"], "revision": revision, "bytes": 123456, "files": 4},
    )  # fmt: skip
    wait_for(
        lambda: (cluster.get(deployment_path(namespace, name)) or {})["spec"]["replicas"] == 2,
        what="replicas start once the cache is ready",
    )
    status = wait_for(
        lambda: (
            (s := llmd_status(cluster, namespace, name))["modelCache"]["state"] == "Ready" and s
        ),
        what="modelCache Ready",
    )
    assert status["modelCache"]["revision"] == revision
    assert status["modelCache"]["bytes"] == 123456
    assert condition(status, "ModelCached")["status"] == "True"
    wait_for(
        lambda: any(
            m.startswith("ModelCached: 123456 bytes") for m in event_messages(cluster, namespace)
        ),
        what="the ModelCached event",
    )


def test_wrong_token_becomes_a_condition_not_a_crash_loop(cluster: EmulatedCluster) -> None:
    namespace, name = "badtoken", "qwen"
    model = {"name": "Qwen/Qwen2.5-7B-Instruct", "source": HF_SOURCE}
    cluster.create(llmd_path(namespace), make_llmd(namespace, name, model=model))
    wait_for(lambda: cluster.get(job_path(namespace, name)), what="loader Job")
    message = "hf://Qwen/Qwen2.5-7B-Instruct@main: the hub refused the credentials (HTTP 401)"
    finish_loader(
        cluster, namespace, name, ok=False, result={"error": "AuthFailed", "message": message}
    )
    status = wait_for(
        lambda: (s := llmd_status(cluster, namespace, name)).get("phase") == "Degraded" and s,
        what="phase Degraded",
    )
    assert condition(status, "Degraded")["reason"] == "AuthFailed"
    assert message in condition(status, "Degraded")["message"]
    assert status["modelCache"]["state"] == "Failed"
    wait_for(
        lambda: any(
            e.get("type") == "Warning" and e.get("reason") == "ModelLoaderAuthFailed"
            for e in events(cluster, namespace)
        ),
        what="a Warning event",
    )
    assert (cluster.get(deployment_path(namespace, name)) or {})["spec"]["replicas"] == 0
    # The failed Job stays (no retry storm); deleting it, after fixing the Secret, retries.
    cluster.delete(job_path(namespace, name))
    wait_for(
        lambda: (cluster.get(job_path(namespace, name)) or {}).get("status") is None,
        what="a new loader Job",
    )


def operator_calls(cluster: EmulatedCluster, namespace: str | None = None) -> list[tuple]:
    return [
        call
        for call in cluster.calls
        if call[0] != TEST_USER_AGENT
        and (namespace is None or f"/namespaces/{namespace}/" in call[2])
    ]


def rbac_rules() -> list[dict[str, Any]]:
    documents = yaml.safe_load_all((MANIFESTS / "rbac.yaml").read_text())
    role = next(doc for doc in documents if doc and doc["kind"] == "ClusterRole")
    return role["rules"]


def granted_permissions() -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) triples the operator's ClusterRole grants."""
    return {
        (group, resource, verb)
        for rule in rbac_rules()
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def used_permissions(cluster: EmulatedCluster) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) triples of every API call the operator made."""
    return {
        permission
        for _, method, path, query in operator_calls(cluster)
        if (permission := requested_permission(method, path, query)) is not None
    }


def requested_permission(
    method: str, path: str, query: dict[str, str]
) -> tuple[str, str, str] | None:
    """(apiGroup, resource[/subresource], verb) of one API call; None for discovery."""
    parts = path.strip("/").split("/")
    if parts[0] == "api":
        group, rest = "", parts[2:]
    elif parts[0] == "apis" and len(parts) > 3:
        group, rest = parts[1], parts[3:]
    else:
        return None  # discovery (/apis, /apis/group/version), open to every authenticated user
    if rest[:1] == ["namespaces"]:
        rest = rest[2:]
    if not rest:
        return None  # discovery (/api, /apis/group/version), open to every authenticated user
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    named = len(rest) > 1
    verbs = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}
    if method == "GET":
        verb = "watch" if query.get("watch") == "true" else ("get" if named else "list")
    else:
        verb = verbs[method]
    return group, resource, verb


POOLS_RESOURCE = "inference.networking.k8s.io/v1/inferencepools"


def pool_path(namespace: str, name: str) -> str:
    return f"/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools/{name}"


def exercise_gateway(cluster: EmulatedCluster, namespace: str, name: str) -> None:
    """spec.routing.gateway on an LLMDeployment with the InferencePool API served: the pool
    and its endpoint picker appear, and go again when the gateway is turned off."""
    cluster.serve_resource(POOLS_RESOURCE, "InferencePool")
    cluster.patch(llmd_path(namespace, name), {"spec": {"routing": {"gateway": {}}}})
    pool = wait_for(lambda: cluster.get(pool_path(namespace, name)), what="InferencePool")
    assert pool["spec"]["endpointPickerRef"]["name"] == f"{name}-epp"
    wait_for(lambda: cluster.get(deployment_path(namespace, f"{name}-epp")), what="picker")
    cluster.patch(llmd_path(namespace, name), {"spec": {"routing": None}})
    wait_for(lambda: cluster.get(pool_path(namespace, name)) is None, what="pool deleted")
    wait_for(
        lambda: cluster.get(deployment_path(namespace, f"{name}-epp")) is None,
        what="picker deleted",
    )


def test_gateway_routing_waits_for_the_inference_pool_api(cluster: EmulatedCluster) -> None:
    """Without the extension's CRD the engines serve and the status says what is missing;
    once the CRD is there the next pass creates the pool and its picker (a spec change here;
    the periodic recheck otherwise: tests/k8s/test_gateway_objects.py)."""
    namespace, name = "gateway", "chat"
    spec = {"routing": {"gateway": {}}}
    if POOLS_RESOURCE not in cluster.served_resources():
        cluster.create(llmd_path(namespace), make_llmd(namespace, name, **spec))
        status = wait_for(
            lambda: (s := llmd_status(cluster, namespace, name))
            and condition(s, "GatewayReady").get("status") == "False"
            and s,
            what="GatewayReady False",
        )
        assert condition(status, "GatewayReady")["reason"] == "MissingAPI"
        assert cluster.get(deployment_path(namespace, name)) is not None
        cluster.serve_resource(POOLS_RESOURCE, "InferencePool")
        picker = {"endpointPicker": {"failureMode": "FailOpen"}}
        cluster.patch(llmd_path(namespace, name), {"spec": {"routing": {"gateway": picker}}})
    else:
        cluster.create(llmd_path(namespace), make_llmd(namespace, name, **spec))
    wait_for(lambda: cluster.get(pool_path(namespace, name)), what="InferencePool")
    wait_for(
        lambda: condition(llmd_status(cluster, namespace, name), "GatewayReady").get("status")
        == "True",
        what="GatewayReady True",
    )
    service = wait_for(lambda: cluster.get(service_path(namespace, f"{name}-epp")), what="EPP")
    assert service["spec"]["ports"][0]["port"] == 9002


def exercise_every_owned_kind(cluster: EmulatedCluster) -> None:
    """Creates, updates and deletes each optional kind once, so the RBAC check below sees
    every call the operator can make, even when this test runs on its own."""
    cluster.serve_resource("monitoring.coreos.com/v1/servicemonitors", "ServiceMonitor")
    namespace, name = "rbac", "qwen"
    autoscaled = {"enabled": True, "minReplicas": 1, "maxReplicas": 3}
    cluster.create(
        llmd_path(namespace), make_llmd(namespace, name, replicas=2, autoscaling=autoscaled)
    )
    hpa_path = f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers/{name}"
    wait_for(lambda: cluster.get(hpa_path), what="HorizontalPodAutoscaler")
    wait_for(lambda: cluster.get(pdb_path(namespace, name)), what="PodDisruptionBudget")
    cluster.patch(
        llmd_path(namespace, name), {"spec": {"replicas": 1, "autoscaling": {"enabled": False}}}
    )
    wait_for(lambda: cluster.get(hpa_path) is None, what="HPA deleted")
    wait_for(lambda: cluster.get(pdb_path(namespace, name)) is None, what="PDB deleted")
    exercise_gateway(cluster, namespace, name)
    # A download source: cache claim and loader Job; a new revision replaces the Job and
    # grows the claim; another kind of source removes both.
    model = {"name": "m", "source": {"uri": "s3://models/m"}}
    cluster.patch(llmd_path(namespace, name), {"spec": {"model": model}})
    job = wait_for(lambda: cluster.get(job_path(namespace, name)), what="loader Job")
    # A claim that stays unbound has its Events read for the status.
    age_claim(cluster, namespace, name)
    wait_for(
        lambda: any(
            method == "GET" and path.endswith(f"/namespaces/{namespace}/events")
            for _, method, path, _ in operator_calls(cluster, namespace)
        ),
        what="the claim's Events read",
    )
    model = {"name": "m", "source": {"uri": "s3://models/m2"}, "cache": {"size": "200Gi"}}
    cluster.patch(llmd_path(namespace, name), {"spec": {"model": model}})
    wait_for(
        lambda: (
            (cluster.get(job_path(namespace, name)) or job)["metadata"]["uid"]
            != job["metadata"]["uid"]
        ),
        what="loader Job replaced",
    )
    cluster.patch(llmd_path(namespace, name), {"spec": {"model": {"source": None}}})
    wait_for(lambda: cluster.get(job_path(namespace, name)) is None, what="Job deleted")
    wait_for(lambda: cluster.get(claim_path(namespace, name)) is None, what="claim deleted")
    # The KEDA backend, with the Prometheus credentials handed over to KEDA.
    cluster.serve_resource("keda.sh/v1alpha1/scaledobjects", "ScaledObject")
    cluster.serve_resource("keda.sh/v1alpha1/triggerauthentications", "TriggerAuthentication")
    keda_path = f"/apis/keda.sh/v1alpha1/namespaces/{namespace}"
    keda = {"enabled": True, "backend": "KEDA", "minReplicas": 1, "maxReplicas": 3}
    prometheus = {
        "url": "http://prometheus.monitoring.svc:9090",
        "bearerTokenSecretRef": {"name": "prometheus-token", "key": "token"},
    }
    cluster.create(
        llmd_path(namespace),
        make_llmd(namespace, "keda", replicas=1, autoscaling=keda, prometheus=prometheus),
    )
    wait_for(lambda: cluster.get(f"{keda_path}/scaledobjects/keda"), what="ScaledObject")
    auth = wait_for(
        lambda: cluster.get(f"{keda_path}/triggerauthentications/keda"), what="TriggerAuth"
    )
    assert auth["spec"]["secretTargetRef"][0]["parameter"] == "bearerToken"
    cluster.patch(llmd_path(namespace, "keda"), {"spec": {"autoscaling": {"enabled": False}}})
    wait_for(
        lambda: cluster.get(f"{keda_path}/scaledobjects/keda") is None, what="ScaledObject deleted"
    )
    wait_for(
        lambda: cluster.get(f"{keda_path}/triggerauthentications/keda") is None,
        what="TriggerAuthentication deleted",
    )


def exercise_live_settings(cluster: EmulatedCluster) -> None:
    """A tuned (Auto) LLMDeployment: its settings ConfigMap is created, updated and deleted
    (tuning off), and its engines' admin Secret created once; the pods read both."""
    namespace, name = "rbac", "tuned"
    tuning = {"mode": "Auto"}
    prometheus = {"url": "http://127.0.0.1:9/"}  # nothing there: the tuner holds
    cluster.create(llmd_path(namespace), make_llmd(
        namespace, name, engine={"maxNumSeqs": 64}, tuning=tuning, prometheus=prometheus))
    settings_path = f"/api/v1/namespaces/{namespace}/configmaps/{name}-engine-settings"
    secret_path = f"/api/v1/namespaces/{namespace}/secrets/{name}-engine-admin"
    settings = wait_for(lambda: cluster.get(settings_path), what="settings ConfigMap")
    assert settings["data"] == {"gpuMemoryUtilization": "0.9", "maxNumSeqs": "64"}
    secret = wait_for(lambda: cluster.get(secret_path), what="admin Secret")
    assert secret["metadata"]["ownerReferences"][0]["kind"] == "LLMDeployment"
    container = engine_container(cluster.get(deployment_path(namespace, name)))
    assert flag_value(container["args"], "--max-num-seqs") == "$(PAGODA_MAX_NUM_SEQS)"
    assert {"name": "admin", "containerPort": 8001, "protocol": "TCP"} in container["ports"]
    cluster.patch(llmd_path(namespace, name), {"spec": {"engine": {"maxNumSeqs": 32}}})
    wait_for(lambda: (cluster.get(settings_path) or {}).get("data", {}).get("maxNumSeqs") == "32",
             what="settings ConfigMap updated")  # fmt: skip
    cluster.patch(llmd_path(namespace, name), {"spec": {"tuning": {"mode": "Off"}}})
    wait_for(lambda: cluster.get(settings_path) is None, what="settings ConfigMap deleted")
    assert cluster.get(secret_path)["data"] == secret["data"]  # made once, never rewritten


def test_rbac_allows_every_call_the_operator_made(cluster: EmulatedCluster) -> None:
    exercise_every_owned_kind(cluster)
    exercise_live_settings(cluster)
    granted = granted_permissions()
    used = used_permissions(cluster)
    assert used <= granted, f"calls outside the ClusterRole: {sorted(used - granted)}"
    # Least privilege: everything granted is something the operator was seen doing, apart
    # from removing a ServiceMonitor, which only happens when a Prometheus Operator goes away,
    # reading a Secret, which the tuner does (tests/tuning/test_tuner_live.py sees it), and
    # listing Prometheus objects, which needs engines Ready for minutes with no series in a
    # Prometheus (tests/k8s/test_diagnosis.py decides from what that list returns), and
    # updating LLMDeployment finalizers: no call makes it, the API server's owner-reference
    # admission checks it (tests/k8s/test_helm.py); and what the endpoint picker's Role grants.
    never_exercised = {
        ("monitoring.coreos.com", "servicemonitors", "delete"),
        ("", "secrets", "get"),
        ("monitoring.coreos.com", "prometheuses", "list"),
        ("pagoda.dev", "llmdeployments/finalizers", "update"),
        # Held only to grant them to the endpoint picker's Role (RBAC's escalation check).
        ("", "pods", "get"),
        ("inference.networking.k8s.io", "inferencepools", "list"),
        ("inference.networking.k8s.io", "inferencepools", "watch"),
        *(
            ("inference.networking.x-k8s.io", resource, verb)
            for resource in ("inferenceobjectives", "inferencemodelrewrites")
            for verb in ("get", "list", "watch")
        ),
    }
    assert granted - used <= never_exercised, sorted(granted - used - never_exercised)


def test_image_entry_point_runs_the_same_operator(tmp_path: Path) -> None:
    """`python -m pagoda_operator` (the operator image's entry point) serves LLMDeployments."""
    with operator_attached(tmp_path, module_entry_command) as cluster:
        cluster.create(llmd_path("entry"), make_llmd("entry", "qwen"))
        wait_for(lambda: cluster.get(deployment_path("entry", "qwen")), what="Deployment")


def test_the_emulator_applies_merge_patches_as_rfc_7386() -> None:
    """A null removes its key, also inside an object the patch adds (the emulator decides
    generation bumps from the merged spec)."""
    from k8s.emulated_cluster import merge_patch

    assert merge_patch({"a": 1}, {"b": {"c": None, "d": 2}}) == {"a": 1, "b": {"d": 2}}
    assert merge_patch({"a": {"x": 1, "y": 2}}, {"a": {"x": None}}) == {"a": {"y": 2}}
    assert merge_patch({"a": [1]}, {"a": [2], "b": None}) == {"a": [2]}
