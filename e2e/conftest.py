"""Cluster access for the e2e suite; every test is skipped, with the reason, without a cluster.

Kind (default): `bash e2e/kind-up.sh`, then `.venv/bin/python -m pytest -q e2e`.
GPU cluster:    `E2E_KUBE_CONTEXT=<context> REGISTRY=<registry> bash e2e/gpu-up.sh` (builds,
                 pushes and checks), then `E2E_GPU=1 E2E_KUBE_CONTEXT=<context>
                 E2E_ENGINE_IMAGE=<image> E2E_OPERATOR_IMAGE=<image> .venv/bin/python -m pytest -q e2e`.

The suite only ever talks to the context it is given (kind-pagoda-e2e by default), never to
whatever kubectl happens to point at.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .checks import KubectlError

REPO_ROOT = Path(__file__).resolve().parent.parent
TOOLS = REPO_ROOT / ".tools" / "bin"
GPU = os.environ.get("E2E_GPU") == "1"
CONTEXT = os.environ.get("E2E_KUBE_CONTEXT", "" if GPU else "kind-pagoda-e2e")


def find_tool(name: str) -> str | None:
    local = TOOLS / name
    return str(local) if local.is_file() else shutil.which(name)


@dataclass
class Cluster:
    context: str
    kubectl_path: str
    helm_path: str
    gpu: bool
    engine_image: str
    operator_image: str
    namespace: str = "pagoda-e2e"
    operator_namespace: str = "pagoda-system"
    release: str = "pagoda"
    extra_helm_args: list[str] = field(default_factory=list)

    def kubectl(self, *args: str, input_text: str | None = None, timeout: float = 120) -> str:
        result = subprocess.run(
            [self.kubectl_path, "--context", self.context, *args],
            input=input_text,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise KubectlError(f"kubectl {' '.join(args)} failed:\n{result.stderr}")
        return result.stdout

    def kubectl_json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json"))

    def exists(self, kind: str, name: str, namespace: str | None = None) -> bool:
        result = subprocess.run(
            [
                self.kubectl_path,
                "--context",
                self.context,
                "get",
                kind,
                name,
                "-n",
                namespace or self.namespace,
                "--ignore-not-found",
                "-o",
                "name",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        return bool(result.stdout.strip())

    def helm(self, *args: str, timeout: float = 600) -> str:
        result = subprocess.run(
            [self.helm_path, "--kube-context", self.context, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result.stdout


def _reachability_problem(kubectl: str | None, helm: str | None) -> str | None:
    if not CONTEXT:
        return "E2E_GPU=1 needs E2E_KUBE_CONTEXT naming the GPU cluster's kubectl context"
    if kubectl is None:
        return "kubectl not found (bash scripts/fetch-k8s-tools.sh .tools)"
    if helm is None:
        return "helm not found (bash scripts/fetch-k8s-tools.sh .tools)"
    try:
        result = subprocess.run(
            [kubectl, "--context", CONTEXT, "get", "--raw", "/readyz", "--request-timeout=5s"],
            capture_output=True,
            text=True,
            timeout=15,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"cluster context {CONTEXT!r} unreachable: {error}"
    if result.returncode != 0:
        hint = "" if GPU else "; create it with `bash e2e/kind-up.sh`"
        return f"no reachable cluster for context {CONTEXT!r}{hint}: {result.stderr.strip()[:200]}"
    return None


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    kubectl, helm = find_tool("kubectl"), find_tool("helm")
    problem = _reachability_problem(kubectl, helm)
    if problem is not None:
        pytest.skip(problem)
    assert kubectl is not None and helm is not None
    if GPU and not os.environ.get("E2E_ENGINE_IMAGE"):
        pytest.skip("E2E_GPU=1 needs E2E_ENGINE_IMAGE (an image built with --target engine)")
    return Cluster(
        context=CONTEXT,
        kubectl_path=kubectl,
        helm_path=helm,
        gpu=GPU,
        engine_image=os.environ.get("E2E_ENGINE_IMAGE", "pagoda-engine-cpu:dev"),
        operator_image=os.environ.get("E2E_OPERATOR_IMAGE", "pagoda-operator:dev"),
    )
