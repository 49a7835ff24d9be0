"""The whole path on a real cluster: helm install, an LLMDeployment, a completion, a rollout,
deletion. Tests run in file order and build on each other."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from .checks import wait_until
from .conftest import REPO_ROOT, Cluster

SAMPLE = REPO_ROOT / "manifests" / "samples" / "llmdeployment-cpu.yaml"
CHART = REPO_ROOT / "helm" / "pagoda-operator"
# CPU pods load the small model in seconds; GPU pods may pull a large image first.
READY_TIMEOUT = 1800 if os.environ.get("E2E_GPU") == "1" else 900


@pytest.fixture(scope="module")
def llmd(cluster: Cluster) -> dict[str, Any]:
    """The sample to deploy: the CPU sample, or its GPU variant under E2E_GPU=1."""
    manifest = yaml.safe_load(SAMPLE.read_text())
    manifest["metadata"]["namespace"] = cluster.namespace
    manifest["spec"]["image"] = cluster.engine_image
    if cluster.gpu:
        manifest["spec"]["imagePullPolicy"] = "IfNotPresent"
        manifest["spec"]["engine"].update({"device": "cuda", "dtype": "auto"})
        manifest["spec"].pop("resources", None)
    return manifest


@pytest.fixture(scope="module", autouse=True)
def namespace(cluster: Cluster) -> Iterator[str]:
    manifest = cluster.kubectl(
        "create", "namespace", cluster.namespace, "--dry-run=client", "-o", "yaml"
    )
    cluster.kubectl("apply", "-f", "-", input_text=manifest)
    yield cluster.namespace
    subprocess.run(
        [
            cluster.helm_path,
            "--kube-context",
            cluster.context,
            "uninstall",
            cluster.release,
            "-n",
            cluster.operator_namespace,
            "--wait",
        ],
        capture_output=True,
        timeout=300,
    )
    cluster.kubectl("delete", "namespace", cluster.namespace, "--ignore-not-found", "--wait=false")


def llmd_status(cluster: Cluster, name: str) -> dict[str, Any]:
    return (
        cluster.kubectl_json("get", "llmdeployment", name, "-n", cluster.namespace).get("status")
        or {}
    )


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


@contextlib.contextmanager
def port_forward(cluster: Cluster, service: str) -> Iterator[str]:
    process = subprocess.Popen(
        [
            cluster.kubectl_path,
            "--context",
            cluster.context,
            "-n",
            cluster.namespace,
            "port-forward",
            f"svc/{service}",
            ":8000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.search(r"127\.0\.0\.1:(\d+)", line)
        assert match, f"port-forward said: {line!r}"
        yield f"http://127.0.0.1:{match.group(1)}"
    finally:
        process.terminate()
        process.wait(timeout=10)


def http(url: str, body: dict[str, Any] | None = None) -> str:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.read().decode()


def test_helm_install(cluster: Cluster, llmd: dict[str, Any]) -> None:
    repository, _, tag = cluster.operator_image.rpartition(":")
    cluster.helm(
        "upgrade",
        "--install",
        cluster.release,
        str(CHART),
        "-n",
        cluster.operator_namespace,
        "--create-namespace",
        "--set",
        f"image.repository={repository}",
        "--set",
        f"image.tag={tag}",
        "--set",
        f"image.pullPolicy={'IfNotPresent' if cluster.gpu else 'Never'}",
        "--set",
        f"engineImage={cluster.engine_image}",
        "--set",
        f"test.namespace={cluster.namespace}",
        "--set",
        f"test.llmDeployment={llmd['metadata']['name']}",
        "--wait",
        "--timeout",
        "5m",
    )
    cluster.kubectl("get", "crd", "llmdeployments.pagoda.dev")


def test_apply_becomes_available(cluster: Cluster, llmd: dict[str, Any]) -> None:
    name = llmd["metadata"]["name"]
    cluster.kubectl("apply", "-f", "-", input_text=yaml.safe_dump(llmd))
    status = wait_until(
        lambda: (s := llmd_status(cluster, name)).get("phase") == "Available" and s,
        READY_TIMEOUT,
        "phase Available",
    )
    assert condition(status, "Available")["status"] == "True"
    deployment = cluster.kubectl_json("get", "deployment", name, "-n", cluster.namespace)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    limits = container["resources"].get("limits") or {}
    if llmd["spec"]["engine"].get("device") == "cpu":
        assert "nvidia.com/gpu" not in limits  # the CPU sample schedules on any node
    else:
        expected = llmd["spec"]["engine"].get("tensorParallelSize", 1)
        assert str(limits["nvidia.com/gpu"]) == str(expected)


def test_completion_through_the_service(cluster: Cluster, llmd: dict[str, Any]) -> None:
    with port_forward(cluster, llmd["metadata"]["name"]) as base:
        models = json.loads(http(f"{base}/v1/models"))
        served = llmd["spec"]["model"]["name"]
        assert served in [model["id"] for model in models["data"]]
        completion = json.loads(
            http(
                f"{base}/v1/completions",
                {
                    "model": served,
                    "prompt": "The capital of France is",
                    "max_tokens": 8,
                    "temperature": 0,
                },
            )
        )
        assert completion["choices"][0]["text"]
        metrics = http(f"{base}/metrics")
    assert "vllm:num_requests_running" in metrics
    assert "vllm:time_to_first_token_seconds" in metrics
    assert f'model_name="{served}"' in metrics


def test_helm_test_calls_v1_models(cluster: Cluster) -> None:
    output = cluster.helm(
        "test", cluster.release, "-n", cluster.operator_namespace, "--timeout", "10m"
    )
    assert "Succeeded" in output


def test_max_num_seqs_change_rolls_out(cluster: Cluster, llmd: dict[str, Any]) -> None:
    name = llmd["metadata"]["name"]
    before = cluster.kubectl_json("get", "llmdeployment", name, "-n", cluster.namespace)
    new_value = before["spec"]["engine"]["maxNumSeqs"] + 4
    cluster.kubectl(
        "patch",
        "llmdeployment",
        name,
        "-n",
        cluster.namespace,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"engine": {"maxNumSeqs": new_value}}}),
    )

    def args_updated() -> bool:
        deployment = cluster.kubectl_json("get", "deployment", name, "-n", cluster.namespace)
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        return args[args.index("--max-num-seqs") + 1] == str(new_value)

    wait_until(args_updated, 60, "--max-num-seqs in the Deployment")
    cluster.kubectl(
        "rollout",
        "status",
        f"deployment/{name}",
        "-n",
        cluster.namespace,
        f"--timeout={READY_TIMEOUT}s",
        timeout=READY_TIMEOUT + 30,
    )
    generation = before["metadata"]["generation"] + 1
    wait_until(
        lambda: (
            (s := llmd_status(cluster, name)).get("phase") == "Available"
            and s.get("observedGeneration") == generation
        ),
        300,
        "Available at the new generation",
    )
    events = cluster.kubectl_json(
        "get", "events", "-n", cluster.namespace, "--field-selector", f"involvedObject.name={name}"
    )
    messages = [event.get("message", "") for event in events["items"]]
    assert any("--max-num-seqs" in m and str(new_value) in m for m in messages), messages


def test_delete_cleans_up(cluster: Cluster, llmd: dict[str, Any]) -> None:
    name = llmd["metadata"]["name"]
    cluster.kubectl(
        "delete", "llmdeployment", name, "-n", cluster.namespace, "--wait=true", timeout=300
    )
    for kind in ("deployment", "service", "poddisruptionbudget"):
        wait_until(lambda k=kind: not cluster.exists(k, name), 300, f"{kind} {name} gone")
    wait_until(
        lambda: (
            not cluster.kubectl(
                "get",
                "pods",
                "-n",
                cluster.namespace,
                "-l",
                f"pagoda.dev/llmdeployment={name}",
                "-o",
                "name",
            ).strip()
        ),
        300,
        "engine pods gone",
    )
