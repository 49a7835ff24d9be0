"""spec.adapters through a real `kopf run` of the operator against the kmock API emulator.

A downloaded adapter is delivered by the loader Job first and only then listed for starting
engines. A running engine, played by a real CPU engine server (tiny model, real LoRA, the
admin API on its own port and key), takes an added adapter live from the operator, reports
a refused one without losing the others, and drops a removed one: the Deployment's pod
template never changes, so no engine restarts."""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
import pytest
from lora_adapters import build_adapter
from server.server_harness import ServerThread
from tiny_models import build_tiny_model

from .emulated_cluster import EmulatedCluster, wait_for
from .test_operator_kmock import (
    condition,
    deployment_path,
    event_messages,
    job_path,
    llmd_path,
    llmd_status,
    make_llmd,
)

MODEL = {"name": "Qwen/Qwen2.5-7B-Instruct", "source": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct"}}
SQL = {"name": "sql", "uri": "hf://acme/qwen-sql-lora"}
CHAT = {"name": "chat", "uri": "s3://adapters/chat"}
ADMIN_KEY = "the-admin-key-of-live"


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


def settings_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/configmaps/{name}-engine-settings"


def startup_adapters(cluster: EmulatedCluster, namespace: str, name: str) -> list[str]:
    """The adapters an engine starting now serves (the settings ConfigMap's list)."""
    data = (cluster.get(settings_path(namespace, name)) or {}).get("data") or {}
    return [module["name"] for module in json.loads(data.get("loraModules") or "[]")]


def pod_template(cluster: EmulatedCluster, namespace: str, name: str) -> str:
    deployment = cluster.get(deployment_path(namespace, name)) or {}
    return json.dumps(deployment["spec"]["template"], sort_keys=True)


def loader_adapters(cluster: EmulatedCluster, namespace: str, name: str) -> int:
    job = cluster.get(job_path(namespace, name)) or {}
    return len(((job.get("spec") or {}).get("template") or {}).get("spec", {})
               .get("initContainers") or [])  # fmt: skip


def test_an_added_adapter_is_downloaded_then_listed_for_the_engines(
    cluster: EmulatedCluster,
) -> None:
    namespace, name = "lora", "qwen"
    cluster.create(llmd_path(namespace), make_llmd(namespace, name, model=MODEL, adapters=[SQL]))
    wait_for(lambda: loader_adapters(cluster, namespace, name) == 1, what="loader with sql")
    finish_job(cluster, namespace, name, "qwen-model-loader-a")
    wait_for(
        lambda: (cluster.get(deployment_path(namespace, name)) or {})["spec"]["replicas"] == 1,
        what="replicas start once the model and its adapter are cached",
    )
    assert startup_adapters(cluster, namespace, name) == ["sql"]
    template = pod_template(cluster, namespace, name)

    cluster.patch(llmd_path(namespace, name), {"spec": {"adapters": [SQL, CHAT]}})
    wait_for(lambda: loader_adapters(cluster, namespace, name) == 2, what="loader with chat")
    status = wait_for(
        lambda: (
            (s := llmd_status(cluster, namespace, name))
            and condition(s, "ModelCached").get("status") == "False"
            and s
        ),
        what="ModelCached False while chat downloads",
    )
    assert condition(status, "ModelCached")["observedGeneration"] == 2
    # An engine starting meanwhile serves sql only: chat's folder is not there yet.
    assert startup_adapters(cluster, namespace, name) == ["sql"]
    assert (cluster.get(deployment_path(namespace, name)) or {})["spec"]["replicas"] == 1

    finish_job(cluster, namespace, name, "qwen-model-loader-b")
    wait_for(lambda: startup_adapters(cluster, namespace, name) == ["sql", "chat"],
             what="chat listed for starting engines once cached")  # fmt: skip
    assert pod_template(cluster, namespace, name) == template  # no engine restarts
    # No engine pod is Ready here (the next test plays one): both wait for one.
    wait_for(lambda: adapter_states(cluster, namespace, name) == {"sql": "Loading",
                                                                  "chat": "Loading"},
             what="both adapters cached, waiting for an engine")  # fmt: skip


# --- a running engine takes its adapters live ----------------------------------------------


@pytest.fixture(scope="module")
def lora_engine(tmp_path_factory: pytest.TempPathFactory):
    """A CPU engine server with LoRA on and the admin API, started as a pod's engine would
    be from the ConfigMap's list: serving sql. Its folder also holds chat and a rank-32
    adapter its --max-lora-rank 16 refuses."""
    from inference.models.config import ModelConfig
    from inference.server.lora_modules import ServedAdapters

    folder = tmp_path_factory.mktemp("live-adapters")
    hf = build_tiny_model(folder / "base", "llama")
    for adapter, rank, seed in (("sql", 8, 1), ("chat", 4, 2), ("too-big", 32, 3)):
        build_adapter(folder / adapter, hf, rank=rank, seed=seed)
    base = str(folder / "base")
    adapters = ServedAdapters(["tiny"], ModelConfig.from_folder(base), 16, enabled=True)
    adapters.add("sql", str(folder / "sql"))
    server = ServerThread(base, served_model_names=["tiny"], max_model_len=128, num_kv_blocks=64,
                          max_num_seqs=4, enable_lora=True, max_loras=2,
                          app_kwargs={"adapters": adapters}, admin_api_key=ADMIN_KEY).start()  # fmt: skip
    yield server, folder
    server.stop()


def engine_pod(cluster: EmulatedCluster, namespace: str, name: str,
               admin_port: int) -> dict[str, Any]:  # fmt: skip
    """What the kubelet reports of the Deployment's one Ready pod: the engine server above
    at its address, on the admin port its container declares."""
    deployment = wait_for(lambda: cluster.get(deployment_path(namespace, name)), what="Deployment")
    template = deployment["spec"]["template"]
    (container,) = template["spec"]["containers"]
    ports = [{**p, "containerPort": admin_port} if p["name"] == "admin" else p
             for p in container["ports"]]  # fmt: skip
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{name}-7d9f-a", "namespace": namespace,
                     "labels": template["metadata"]["labels"]},
        "spec": {"containers": [{"name": "engine", "image": container["image"], "ports": ports}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1",
                   "conditions": [{"type": "Ready", "status": "True"}]},
    }  # fmt: skip


def served_models(server: ServerThread) -> list[str]:
    return [card["id"] for card in httpx.get(f"{server.base_url}/v1/models", timeout=10)
            .json()["data"]]  # fmt: skip


def adapter_states(cluster: EmulatedCluster, namespace: str, name: str) -> dict[str, str]:
    return states_in(llmd_status(cluster, namespace, name))


def states_in(status: dict) -> dict[str, str]:
    return {a["name"]: a["state"] for a in status.get("adapters") or []}


def test_a_running_engine_takes_adapters_live_without_a_restart(
    cluster: EmulatedCluster, lora_engine
) -> None:
    server, folder = lora_engine
    namespace, name = "lora", "live"
    sql, chat, big = (
        {"name": adapter, "uri": str(folder / path)}
        for adapter, path in (("sql", "sql"), ("chat", "chat"), ("big", "too-big"))
    )
    # The engines' admin key: the Secret the operator would make, made here with the one the
    # engine server runs with.
    cluster.create(f"/api/v1/namespaces/{namespace}/secrets", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{name}-engine-admin"},
        "data": {"admin-api-key": base64.b64encode(ADMIN_KEY.encode()).decode()}})  # fmt: skip
    cluster.create(llmd_path(namespace), make_llmd(namespace, name, adapters=[sql]))
    admin_port = int(server.admin_url.rsplit(":", 1)[1])
    cluster.create(
        f"/api/v1/namespaces/{namespace}/pods", engine_pod(cluster, namespace, name, admin_port)
    )
    wait_for(lambda: adapter_states(cluster, namespace, name) == {"sql": "Loaded"},
             what="sql reported Loaded in the running engine")  # fmt: skip
    template = pod_template(cluster, namespace, name)
    assert served_models(server) == ["tiny", "sql"]

    # Added: loaded live into the engine, listed by its /v1/models, and served.
    cluster.patch(llmd_path(namespace, name), {"spec": {"adapters": [sql, chat]}})
    wait_for(lambda: adapter_states(cluster, namespace, name) == {"sql": "Loaded",
                                                                  "chat": "Loaded"},
             what="chat loaded live")  # fmt: skip
    assert served_models(server) == ["tiny", "sql", "chat"]
    body = {"model": "chat", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
    assert httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).status_code == 200
    assert startup_adapters(cluster, namespace, name) == ["sql", "chat"]
    status = llmd_status(cluster, namespace, name)
    assert condition(status, "AdaptersReady")["status"] == "True"
    assert status["adapters"][1]["pods"] == [{"name": f"{name}-7d9f-a", "state": "Loaded"}]
    assert any(m.startswith("AdapterLoaded: adapter chat loaded live into live-7d9f-a")
               for m in event_messages(cluster, namespace))  # fmt: skip

    # Refused by the engine (rank 32 > --max-lora-rank 16): Failed, naming the pod; the
    # others keep serving.
    cluster.patch(llmd_path(namespace, name), {"spec": {"adapters": [sql, chat, big]}})
    # (one read: the states and the condition of the same status)
    status = wait_for(lambda: (s := llmd_status(cluster, namespace, name))
                      and states_in(s).get("big") == "Failed" and s,
                      what="big reported Failed")  # fmt: skip
    ready = condition(status, "AdaptersReady")
    assert ready["status"] == "False" and ready["reason"] == "AdapterFailed"
    assert "adapter big: pod live-7d9f-a refused it" in ready["message"]
    assert "exceeds --max-lora-rank 16" in ready["message"]
    assert served_models(server) == ["tiny", "sql", "chat"]
    wait_for(
        lambda: any(
            m.startswith("AdapterFailed: adapter big: pod live-7d9f-a")
            for m in event_messages(cluster, namespace)
        ),
        what="AdapterFailed Event",
    )

    # Removed: unloaded live; the engine no longer lists it.
    cluster.patch(llmd_path(namespace, name), {"spec": {"adapters": [sql]}})
    wait_for(lambda: served_models(server) == ["tiny", "sql"], what="chat unloaded live")
    wait_for(lambda: adapter_states(cluster, namespace, name) == {"sql": "Loaded"},
             what="only sql reported")  # fmt: skip
    assert startup_adapters(cluster, namespace, name) == ["sql"]
    assert any(m.startswith("AdapterUnloaded: adapter chat unloaded from live-7d9f-a")
               for m in event_messages(cluster, namespace))  # fmt: skip
    # Through all of it, the Deployment's pod template never changed: no engine restarted.
    assert pod_template(cluster, namespace, name) == template
