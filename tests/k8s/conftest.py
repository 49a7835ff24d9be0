"""Shared fixtures of the Kubernetes tests: repository paths, the CRD, helm, the emulator."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from .emulated_cluster import EmulatedCluster, wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = REPO_ROOT / "manifests"
CHART = REPO_ROOT / "helm" / "pagoda-operator"
OPERATOR_SOURCE = REPO_ROOT / "operator"

# The operator package is importable without `pip install -e .` too.
if str(OPERATOR_SOURCE) not in sys.path:
    sys.path.insert(0, str(OPERATOR_SOURCE))


def load_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.fixture(scope="session")
def crd() -> dict[str, Any]:
    return load_documents(MANIFESTS / "crd.yaml")[0]


def find_helm() -> str | None:
    local = REPO_ROOT / ".tools" / "bin" / "helm"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("helm")


@pytest.fixture(scope="session")
def helm() -> str:
    path = find_helm()
    if path is None:
        pytest.skip(
            "helm not found in .tools/bin or on PATH; run `bash scripts/fetch-k8s-tools.sh .tools`"
        )
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _liveness_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def kopf_run_command(liveness: str) -> list[str]:
    return [
        sys.executable, "-m", "kopf", "run", "--standalone", "--all-namespaces",
        f"--liveness={liveness}", "-m", "pagoda_operator.handlers",
    ]  # fmt: skip


def module_entry_command(liveness: str) -> list[str]:
    """The operator image's entry point; it reads the liveness URL from the environment."""
    return [sys.executable, "-m", "pagoda_operator"]


@contextlib.contextmanager
def operator_attached(
    workdir: Path, command_for: Callable[[str], list[str]]
) -> Iterator[EmulatedCluster]:
    """An emulated API server with an operator process attached, both stopped on exit."""
    emulated = EmulatedCluster().start()
    kubeconfig = emulated.write_kubeconfig(workdir / "kubeconfig")
    liveness = f"http://127.0.0.1:{_free_port()}/healthz"
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(OPERATOR_SOURCE), os.environ.get("PYTHONPATH")])
        ),
        "PAGODA_ENGINE_IMAGE": "registry.test/pagoda-engine:test",
        "PAGODA_LIVENESS_ENDPOINT": liveness,
    }
    log_path = workdir / "operator.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command_for(liveness), env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT
        )
    try:
        wait_for(
            lambda: _liveness_ok(liveness) or process.poll() is not None, what="operator start"
        )
        assert process.poll() is None, f"operator exited:\n{log_path.read_text()[-3000:]}"
        wait_for(
            lambda: sum(1 for call in emulated.calls if call[3].get("watch") == "true") >= 2,
            what="the operator's watch streams",
        )
        yield emulated
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        emulated.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatedCluster]:
    """The emulated API server with a real `kopf run` process of the operator attached."""
    with operator_attached(tmp_path_factory.mktemp("kmock"), kopf_run_command) as emulated:
        yield emulated
