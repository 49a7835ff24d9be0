"""On a real cluster: a model downloaded from an S3 store into the model cache, a rollout
on a cluster with no spare GPU, a drain with requests in flight (none may fail), and the
deletion of a tuned LLMDeployment after the operator is uninstalled.

Kind: `bash e2e/kind-up.sh` (4 fake GPUs on the node), then `.venv/bin/python -m pytest -q
e2e`. The S3 store is a MinIO pod in the test namespace, filled by a Job that uploads the
embedded SmolLM2 folder from the engine image (which carries boto3 for `pagoda download`).
Tests run in file order and build on each other.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from .checks import free_gpus, wait_until
from .conftest import Cluster
from .test_llmdeployment import CHART, READY_TIMEOUT, http, port_forward

NAMESPACE = "pagoda-e2e-ops"
MINIO_IMAGE = "quay.io/minio/minio:RELEASE.2025-04-22T22-12-26Z"
MINIO_USER, MINIO_PASSWORD = "pagoda-e2e", "pagoda-e2e-secret"


def kubectl(cluster: Cluster, *args: str, **kwargs: Any) -> str:
    return cluster.kubectl(*args, "-n", NAMESPACE, **kwargs)


def get(cluster: Cluster, kind: str, name: str) -> dict[str, Any]:
    return json.loads(kubectl(cluster, "get", kind, name, "-o", "json"))


def apply(cluster: Cluster, *documents: dict[str, Any]) -> None:
    kubectl(cluster, "apply", "-f", "-", input_text=yaml.safe_dump_all(documents))


def status(cluster: Cluster, name: str) -> dict[str, Any]:
    return get(cluster, "llmdeployment", name).get("status") or {}


def wait_available(cluster: Cluster, name: str, generation: int | None = None) -> dict[str, Any]:
    def available() -> dict[str, Any] | None:
        current = status(cluster, name)
        if current.get("phase") != "Available":
            return None
        if generation is not None and current.get("observedGeneration") != generation:
            return None
        return current

    return wait_until(available, READY_TIMEOUT, f"{name} Available")


def llmd(cluster: Cluster, name: str, **spec: Any) -> dict[str, Any]:
    engine = {"maxNumSeqs": 8, "maxModelLen": 2048, "dtype": "float32", "device": "cpu"}
    if cluster.gpu:
        engine.update(device="cuda", dtype="auto")
    engine.update(spec.pop("engine", {}))
    return {
        "apiVersion": "pagoda.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"name": "smollm2-135m-instruct"},
            "image": cluster.engine_image,
            "imagePullPolicy": "IfNotPresent" if cluster.gpu else "Never",
            "startupTimeoutSeconds": 600,
            "engine": engine,
            **spec,
        },
    }


def job_succeeds(cluster: Cluster, name: str, timeout: float) -> None:
    def finished() -> str | None:
        job_status = get(cluster, "job", name).get("status") or {}
        if job_status.get("succeeded"):
            return "ok"
        if job_status.get("failed"):
            logs = kubectl(cluster, "logs", f"job/{name}", "--tail=50")
            raise AssertionError(f"job {name} failed:\n{logs}")
        return None

    wait_until(finished, timeout, f"job {name}")


def python_job(cluster: Cluster, name: str, script: str, env: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "main",
                            "image": cluster.engine_image,
                            "imagePullPolicy": "IfNotPresent" if cluster.gpu else "Never",
                            "command": ["python", "-c", textwrap.dedent(script)],
                            "env": [{"name": k, "value": v} for k, v in env.items()],
                        }
                    ],
                }
            },
        },
    }


@pytest.fixture(scope="module", autouse=True)
def installed(cluster: Cluster) -> Iterator[None]:
    manifest = cluster.kubectl("create", "namespace", NAMESPACE, "--dry-run=client", "-o", "yaml")
    cluster.kubectl("apply", "-f", "-", input_text=manifest)
    repository, _, tag = cluster.operator_image.rpartition(":")
    cluster.helm(
        "upgrade", "--install", cluster.release, str(CHART), "-n", cluster.operator_namespace,
        "--create-namespace", "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
        "--set", f"image.pullPolicy={'IfNotPresent' if cluster.gpu else 'Never'}",
        "--set", f"engineImage={cluster.engine_image}", "--wait", "--timeout", "5m",
    )  # fmt: skip
    yield
    subprocess.run(
        [cluster.helm_path, "--kube-context", cluster.context, "uninstall", cluster.release,
         "-n", cluster.operator_namespace, "--wait"],
        capture_output=True, timeout=300,
    )  # fmt: skip
    cluster.kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=false")


# --- a model from S3 ----------------------------------------------------------------------------


def test_model_from_s3_is_cached_then_served(cluster: Cluster) -> None:
    minio_labels = {"app": "minio"}
    apply(
        cluster,
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "minio", "namespace": NAMESPACE},
            "spec": {
                "selector": {"matchLabels": minio_labels},
                "template": {
                    "metadata": {"labels": minio_labels},
                    "spec": {
                        "containers": [
                            {
                                "name": "minio",
                                "image": MINIO_IMAGE,
                                "args": ["server", "/data"],
                                "env": [
                                    {"name": "MINIO_ROOT_USER", "value": MINIO_USER},
                                    {"name": "MINIO_ROOT_PASSWORD", "value": MINIO_PASSWORD},
                                ],
                                "ports": [{"containerPort": 9000}],
                                "readinessProbe": {
                                    "httpGet": {"path": "/minio/health/ready", "port": 9000}
                                },
                            }
                        ]
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "minio", "namespace": NAMESPACE},
            "spec": {"selector": minio_labels, "ports": [{"port": 9000, "targetPort": 9000}]},
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "model-store", "namespace": NAMESPACE},
            "stringData": {"AWS_ACCESS_KEY_ID": MINIO_USER, "AWS_SECRET_ACCESS_KEY": MINIO_PASSWORD},
        },
    )
    kubectl(cluster, "rollout", "status", "deployment/minio", "--timeout=300s", timeout=330)
    upload = """
        import boto3, pathlib
        from inference.model_files import ensure_default_model
        folder = pathlib.Path(ensure_default_model())
        s3 = boto3.client("s3", endpoint_url="http://minio:9000", region_name="us-east-1")
        s3.create_bucket(Bucket="models")
        for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")):
            s3.upload_file(str(path), "models", f"smollm2/{path.relative_to(folder)}")
        print("uploaded", folder)
    """
    env = {"AWS_ACCESS_KEY_ID": MINIO_USER, "AWS_SECRET_ACCESS_KEY": MINIO_PASSWORD}
    apply(cluster, python_job(cluster, "upload-model", upload, env))
    job_succeeds(cluster, "upload-model", 900)

    source = {
        "uri": "s3://models/smollm2",
        "endpoint": "http://minio:9000",
        "credentialsSecret": {"name": "model-store"},
    }
    obj = llmd(cluster, "from-s3")
    obj["spec"]["model"].update(source=source, cache={"size": "2Gi"})
    apply(cluster, obj)
    job_succeeds(cluster, "from-s3-model-loader", 900)
    current = wait_available(cluster, "from-s3")
    assert current["modelCache"]["state"] == "Ready"
    assert current["modelCache"]["bytes"] > 100_000_000
    with port_forward_in(cluster, "from-s3") as base:
        body = {"model": "smollm2-135m-instruct", "prompt": "The capital of France is", "max_tokens": 8}
        assert json.loads(http(f"{base}/v1/completions", body))["choices"][0]["text"]


def test_wrong_credentials_are_a_condition(cluster: Cluster) -> None:
    apply(
        cluster,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "wrong-store", "namespace": NAMESPACE},
            "stringData": {"AWS_ACCESS_KEY_ID": MINIO_USER, "AWS_SECRET_ACCESS_KEY": "wrong"},
        },
    )
    obj = llmd(cluster, "bad-creds")
    obj["spec"]["model"].update(
        source={
            "uri": "s3://models/smollm2",
            "endpoint": "http://minio:9000",
            "credentialsSecret": {"name": "wrong-store"},
        },
        cache={"size": "2Gi"},
    )
    apply(cluster, obj)
    current = wait_until(
        lambda: (s := status(cluster, "bad-creds")).get("phase") == "Degraded" and s,
        600,
        "Degraded for wrong credentials",
    )
    degraded = next(c for c in current["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "AuthFailed", degraded
    job = get(cluster, "job", "bad-creds-model-loader")
    assert (job.get("status") or {}).get("failed") == 1  # stopped at once, no retries
    kubectl(cluster, "delete", "llmdeployment", "bad-creds", "--wait=true", timeout=120)


# --- a rollout with no spare GPU ----------------------------------------------------------------


def cluster_free_gpus(cluster: Cluster) -> int:
    nodes = cluster.kubectl_json("get", "nodes")["items"]
    pods = cluster.kubectl_json("get", "pods", "--all-namespaces")["items"]
    return free_gpus(nodes, pods)


def test_rollout_with_every_gpu_taken(cluster: Cluster) -> None:
    gpus = cluster_free_gpus(cluster)
    if not 1 <= gpus <= 8:
        pytest.skip(f"needs 1-8 GPUs in the cluster to fill them all (found {gpus})")
    obj = llmd(cluster, "full", replicas=gpus, engine={"device": "cuda" if cluster.gpu else "auto"})
    obj["spec"]["resources"] = {"requests": {"cpu": "100m", "memory": "512Mi"}}
    apply(cluster, obj)
    before = wait_available(cluster, "full")
    assert before["readyReplicas"] == gpus  # every GPU of the cluster is taken now
    kubectl(
        cluster, "patch", "llmdeployment", "full", "--type=merge",
        "-p", json.dumps({"spec": {"engine": {"maxNumSeqs": 4}}}),
    )  # fmt: skip
    generation = get(cluster, "llmdeployment", "full")["metadata"]["generation"]
    # The default rollout (maxSurge 0) needs no spare GPU: it completes.
    kubectl(cluster, "rollout", "status", "deployment/full", f"--timeout={READY_TIMEOUT}s",
            timeout=READY_TIMEOUT + 30)  # fmt: skip
    wait_available(cluster, "full", generation)
    kubectl(cluster, "delete", "llmdeployment", "full", "--wait=true", timeout=300)


# --- a drain with requests in flight ------------------------------------------------------------


def test_drain_with_requests_in_flight_fails_none(cluster: Cluster) -> None:
    apply(cluster, llmd(cluster, "drain", replicas=2))
    wait_until(
        lambda: status(cluster, "drain").get("readyReplicas") == 2, READY_TIMEOUT, "2 ready"
    )
    client = """
        import json, threading, time, urllib.request
        failures, done = [], []
        def worker():
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                body = json.dumps({"model": "smollm2-135m-instruct", "max_tokens": 128,
                                   "prompt": "Write a long story about a lighthouse."}).encode()
                request = urllib.request.Request("http://drain:8000/v1/completions", data=body,
                                                 headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(request, timeout=300) as response:
                        json.loads(response.read())
                        done.append(1)
                except Exception as error:
                    failures.append(repr(error))
        threads = [threading.Thread(target=worker) for _ in range(6)]
        for thread in threads: thread.start()
        for thread in threads: thread.join()
        print(f"{len(done)} completed, {len(failures)} failed: {failures[:5]}")
        raise SystemExit(1 if failures or not done else 0)
    """
    apply(cluster, python_job(cluster, "drain-client", client, {}))
    wait_until(
        lambda: (get(cluster, "job", "drain-client").get("status") or {}).get("active"),
        300,
        "the client running",
    )
    time.sleep(15)  # requests in flight on both replicas
    pods = kubectl(
        cluster, "get", "pods", "-l", "pagoda.dev/llmdeployment=drain", "-o", "name"
    ).split()
    # What a node drain does to a pod: an eviction (the disruption budget allows one).
    kubectl(cluster, "delete", pods[0], "--wait=false")
    job_succeeds(cluster, "drain-client", 600)
    kubectl(cluster, "delete", "llmdeployment", "drain", "--wait=true", timeout=300)


# --- deleting a tuned object once the operator is gone --------------------------------------------


def test_tuned_object_deletes_after_uninstall(cluster: Cluster) -> None:
    obj = llmd(
        cluster, "tuned",
        tuning={"mode": "Recommend"}, prometheus={"url": "http://prometheus.invalid:9090"},
    )  # fmt: skip
    apply(cluster, obj)
    wait_until(lambda: cluster.exists("deployment", "tuned", NAMESPACE), 120, "the Deployment")
    assert not get(cluster, "llmdeployment", "tuned")["metadata"].get("finalizers")
    cluster.helm("uninstall", cluster.release, "-n", cluster.operator_namespace, "--wait")
    # The CRD is kept; with no finalizer the object goes at once, operator or not.
    kubectl(cluster, "delete", "llmdeployment", "tuned", "--wait=true", "--timeout=60s", timeout=90)
    assert not cluster.exists("llmdeployment", "tuned", NAMESPACE)


def port_forward_in(cluster: Cluster, service: str):
    """port_forward of test_llmdeployment, in this module's namespace."""
    return port_forward(Cluster(**{**cluster.__dict__, "namespace": NAMESPACE}), service)
