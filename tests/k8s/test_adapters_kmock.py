"""spec.adapters through a real `kopf run` of the operator against the kmock API emulator:
an added adapter is downloaded first, then rolled out; the serving pods keep theirs meanwhile."""

from __future__ import annotations

import json

from .emulated_cluster import EmulatedCluster, wait_for
from .test_operator_kmock import (
    condition,
    deployment_path,
    engine_container,
    job_path,
    llmd_path,
    llmd_status,
    make_llmd,
)

MODEL = {"name": "Qwen/Qwen2.5-7B-Instruct", "source": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct"}}
SQL = {"name": "sql", "uri": "hf://acme/qwen-sql-lora"}
CHAT = {"name": "chat", "uri": "s3://adapters/chat"}


def finish_job(cluster: EmulatedCluster, namespace: str, name: str, pod_name: str) -> None:
    """What the Job controller and kubelet do when every loader container succeeded."""
    job = cluster.get(job_path(namespace, name))
    assert job is not None
    labels = {
        **job["spec"]["template"]["metadata"]["labels"],
        "batch.kubernetes.io/job-name": job["metadata"]["name"],
    }
    done = {"terminated": {"exitCode": 0, "message": json.dumps({"bytes": 1, "files": 1})}}
    init = [{"name": c["name"], "state": done}
            for c in job["spec"]["template"]["spec"].get("initContainers") or []]  # fmt: skip
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": pod_name, "namespace": namespace, "labels": labels},
        "spec": job["spec"]["template"]["spec"],
        "status": {"phase": "Succeeded", "initContainerStatuses": init,
                   "containerStatuses": [{"name": "loader", "state": done}]},
    }  # fmt: skip
    cluster.create(f"/api/v1/namespaces/{namespace}/pods", pod)
    status = {"conditions": [{"type": "Complete", "status": "True"}], "succeeded": 1}
    cluster.patch(job_path(namespace, name) + "/status", {"status": status})


def served_adapters(cluster: EmulatedCluster, namespace: str, name: str) -> list[str]:
    args = engine_container(cluster.get(deployment_path(namespace, name)) or {})["args"]
    if "--lora-modules" not in args:
        return []
    start = args.index("--lora-modules") + 1
    names = []
    for arg in args[start:]:
        if arg.startswith("--"):
            break
        names.append(arg.split("=", 1)[0])
    return names


def loader_adapters(cluster: EmulatedCluster, namespace: str, name: str) -> int:
    job = cluster.get(job_path(namespace, name)) or {}
    return len(((job.get("spec") or {}).get("template") or {}).get("spec", {})
               .get("initContainers") or [])  # fmt: skip


def test_an_added_adapter_is_downloaded_then_rolled_out(cluster: EmulatedCluster) -> None:
    namespace, name = "lora", "qwen"
    cluster.create(llmd_path(namespace), make_llmd(namespace, name, model=MODEL, adapters=[SQL]))
    wait_for(lambda: loader_adapters(cluster, namespace, name) == 1, what="loader with sql")
    finish_job(cluster, namespace, name, "qwen-model-loader-a")
    wait_for(
        lambda: (cluster.get(deployment_path(namespace, name)) or {})["spec"]["replicas"] == 1,
        what="replicas start once the model and its adapter are cached",
    )
    assert served_adapters(cluster, namespace, name) == ["sql"]

    cluster.patch(llmd_path(namespace, name), {"spec": {"adapters": [SQL, CHAT]}})
    wait_for(lambda: loader_adapters(cluster, namespace, name) == 2, what="loader with chat")
    status = wait_for(
        lambda: (s := llmd_status(cluster, namespace, name))
        and condition(s, "ModelCached").get("status") == "False" and s,
        what="ModelCached False while chat downloads",
    )
    assert condition(status, "ModelCached")["observedGeneration"] == 2
    # The serving pods keep their adapters until chat is in the cache (no pod that would
    # fail to find its folder).
    assert served_adapters(cluster, namespace, name) == ["sql"]
    assert (cluster.get(deployment_path(namespace, name)) or {})["spec"]["replicas"] == 1

    finish_job(cluster, namespace, name, "qwen-model-loader-b")
    wait_for(
        lambda: served_adapters(cluster, namespace, name) == ["sql", "chat"],
        what="the Deployment rolls out with chat",
    )
