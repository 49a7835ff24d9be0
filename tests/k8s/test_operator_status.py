"""What a first real cluster throws at the operator, through a real `kopf run` against the
emulator: immutable claims, pods that cannot start, absent optional integrations. Each
ends as a condition that says why, and never stops the Deployment from being applied."""

from __future__ import annotations

from typing import Any

from .emulated_cluster import EmulatedCluster, wait_for
from .test_operator_kmock import (
    HF_SOURCE,
    age_claim,
    claim_path,
    condition,
    deployment_path,
    finish_loader,
    llmd_path,
    llmd_status,
    make_llmd,
)


def deployment_replicas(cluster: EmulatedCluster, namespace: str, name: str) -> Any:
    return ((cluster.get(deployment_path(namespace, name)) or {}).get("spec") or {}).get("replicas")


def test_scaling_a_downloaded_model_keeps_its_claim_and_scales(cluster: EmulatedCluster) -> None:
    namespace, name = "scale-cache", "qwen"
    model = {"name": "Qwen/Qwen2.5-7B-Instruct", "source": HF_SOURCE}
    cluster.create(llmd_path(namespace), make_llmd(namespace, name, model=model, replicas=1))
    claim = wait_for(lambda: cluster.get(claim_path(namespace, name)), what="cache claim")
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    finish_loader(cluster, namespace, name, ok=True, result={"revision": "a" * 40, "bytes": 1})
    wait_for(lambda: deployment_replicas(cluster, namespace, name) == 1, what="1 replica")

    cluster.patch(llmd_path(namespace, name), {"spec": {"replicas": 2}})
    wait_for(
        lambda: deployment_replicas(cluster, namespace, name) == 2,
        what=lambda: f"2 replicas; status {llmd_status(cluster, namespace, name)}",
    )
    assert cluster.get(claim_path(namespace, name))["spec"]["accessModes"] == ["ReadWriteOnce"]
    status = wait_for(
        lambda: (s := llmd_status(cluster, namespace, name)).get("replicas") is not None and s,
        what="status",
    )
    assert status["phase"] != "Degraded", status
    synced = wait_for(
        lambda: condition(llmd_status(cluster, namespace, name), "ModelCacheSynced"),
        what="ModelCacheSynced",
    )
    assert synced["status"] == "False" and "Multi-Attach" in synced["message"]

    # An asked change that the claim cannot take is said, naming the field; scaling goes on.
    model["cache"] = {"accessMode": "ReadWriteMany"}
    cluster.patch(llmd_path(namespace, name), {"spec": {"model": model, "replicas": 3}})
    wait_for(lambda: deployment_replicas(cluster, namespace, name) == 3, what="3 replicas")
    synced = wait_for(
        lambda: (
            "spec.model.cache.accessMode"
            in (c := condition(llmd_status(cluster, namespace, name), "ModelCacheSynced")).get(
                "message", ""
            )
            and c
        ),
        what="the accessMode problem",
    )
    assert synced["reason"] == "ImmutableField"
    assert cluster.get(claim_path(namespace, name))["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_keda_missing_is_a_condition_and_the_engines_still_run(cluster: EmulatedCluster) -> None:
    namespace, name = "no-keda", "qwen"
    keda = {"enabled": True, "backend": "KEDA", "minReplicas": 1, "maxReplicas": 3}
    prometheus = {"url": "http://prometheus.monitoring.svc:9090"}
    cluster.create(
        llmd_path(namespace),
        make_llmd(namespace, name, replicas=2, autoscaling=keda, prometheus=prometheus),
    )
    wait_for(lambda: deployment_replicas(cluster, namespace, name) == 2, what="the Deployment")
    wait_for(lambda: cluster.get(f"/api/v1/namespaces/{namespace}/services/{name}"), what="Svc")
    ready = wait_for(
        lambda: condition(llmd_status(cluster, namespace, name), "AutoscalingReady"),
        what="AutoscalingReady",
    )
    assert ready["status"] == "False" and ready["reason"] == "MissingAPI"
    assert "install KEDA" in ready["message"]
    assert llmd_status(cluster, namespace, name)["phase"] != "Degraded"


def test_a_claim_that_does_not_bind_is_said_with_its_events(cluster: EmulatedCluster) -> None:
    namespace, name = "pending-claim", "qwen"
    model = {"name": "Qwen/Qwen2.5-7B-Instruct", "source": HF_SOURCE}
    cluster.create(llmd_path(namespace), make_llmd(namespace, name, model=model))
    said = "no persistent volumes available for this claim and no storage class is set"
    claim = wait_for(lambda: cluster.get(claim_path(namespace, name)), what="cache claim")
    cluster.create(
        f"/api/v1/namespaces/{namespace}/events",
        {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": "qwen-model-cache.1", "namespace": namespace},
            "type": "Normal",
            "reason": "FailedBinding",
            "message": said,
            "involvedObject": {
                "kind": "PersistentVolumeClaim",
                "name": claim["metadata"]["name"],
                "namespace": namespace,
            },
        },
    )
    age_claim(cluster, namespace, name)
    cached = wait_for(
        lambda: (
            (c := condition(llmd_status(cluster, namespace, name), "ModelCached")).get("reason")
            == "PVCPending"
            and c
        ),
        what=lambda: f"PVCPending; status {llmd_status(cluster, namespace, name)}",
    )
    assert said in cached["message"]
