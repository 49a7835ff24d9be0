"""The plain manifests: valid for Kubernetes, samples valid for the CRD, bad samples refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from pagoda_operator.spec import SPEC_DEFAULTS, validate_spec, with_defaults

from .conftest import MANIFESTS, load_documents
from .crd_schema import apply_defaults, validation_errors, version_schema

# Oldest Kubernetes the chart supports and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.31", kubernetes_validate.utils.latest_version())
INVALID_SAMPLES = sorted((Path(__file__).parent / "data" / "invalid").glob("*.yaml"))
SAMPLES = sorted((MANIFESTS / "samples").glob("*.yaml"))
PLAIN_MANIFESTS = sorted(MANIFESTS.glob("*.yaml")) + [MANIFESTS / "router" / "router.yaml"]


def validate_for_kubernetes(document: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(document, version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", PLAIN_MANIFESTS, ids=lambda p: p.name)
def test_plain_manifests_validate(path: Path, version: str) -> None:
    for document in load_documents(path):
        validate_for_kubernetes(document, version)


def test_crd_identity(crd: dict[str, Any]) -> None:
    spec = crd["spec"]
    assert (spec["group"], spec["scope"]) == ("pagoda.dev", "Namespaced")
    assert spec["names"]["plural"] == "llmdeployments"
    assert spec["names"]["shortNames"] == ["llmd"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = [column["name"] for column in version["additionalPrinterColumns"]]
    assert columns == ["Model", "TP", "Replicas", "MaxSeqs", "GPUMem", "Ready", "Phase", "Age"]


def test_crd_defaults_match_the_operator(crd: dict[str, Any]) -> None:
    """The API server and the operator fill in the same defaults."""
    schema = version_schema(crd)
    minimal = {"model": {"name": "m"}}
    from_crd = apply_defaults(schema["properties"]["spec"], minimal)
    from_operator = with_defaults(minimal)
    # The CRD leaves maxNumSeqs to the engine, whose default the operator fills in (and
    # tests/test_settings_contract.py checks against the engine's).
    assert "maxNumSeqs" not in from_crd["engine"]
    del from_operator["engine"]["maxNumSeqs"]
    for key in SPEC_DEFAULTS:
        assert from_crd[key] == from_operator[key], key


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_samples_validate_against_the_crd(crd: dict[str, Any], path: Path) -> None:
    (sample,) = load_documents(path)
    assert validation_errors(crd, sample) == []
    assert validate_spec(with_defaults(sample["spec"])) == []


def rendered_deployment(sample: dict[str, Any]) -> dict[str, Any]:
    from pagoda_operator.desired import desired_objects

    sample["metadata"]["uid"] = "uid-1"
    (deployment,) = [
        obj
        for obj in desired_objects(sample, service_monitor_api=False)
        if obj["kind"] == "Deployment" and obj["metadata"]["name"] == sample["metadata"]["name"]
    ]  # the engines' (a gateway sample also has its endpoint picker's)
    return deployment


# Labels that only Node Feature Discovery or the NVIDIA GPU Operator put on nodes: a stock
# GKE/EKS/AKS cluster with the device plugin alone has none of them, so a pod selecting one
# stays Pending.
ADD_ON_NODE_LABEL_PREFIXES = ("feature.node.kubernetes.io/", "nvidia.com/")


def node_labels_required(pod: dict[str, Any]) -> set[str]:
    keys = set(pod.get("nodeSelector") or {})
    required = ((pod.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    for term in required.get("nodeSelectorTerms") or []:
        keys |= {expr["key"] for expr in term.get("matchExpressions") or []}
    return keys


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_samples_render_to_a_deployment_that_schedules_without_add_ons(path: Path) -> None:
    (sample,) = load_documents(path)
    pod = rendered_deployment(sample)["spec"]["template"]["spec"]
    for key in node_labels_required(pod):
        assert not key.startswith(ADD_ON_NODE_LABEL_PREFIXES), f"{path.name} needs node label {key}"
    limits = pod["containers"][0]["resources"].get("limits") or {}
    if "nvidia.com/gpu" in limits:
        # GPU node pools on GKE and EKS carry this taint.
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in (
            pod.get("tolerations") or []
        ), path.name


def test_the_gpu_sample_needs_nothing_a_stock_cluster_lacks() -> None:
    """Only the NVIDIA device plugin: no KEDA, no Prometheus, no volume made beforehand;
    GPUs requested as nvidia.com/gpu, as many as the tensor-parallel size."""
    (sample,) = load_documents(MANIFESTS / "samples" / "llmdeployment-gpu.yaml")
    spec = sample["spec"]
    assert spec["model"]["source"]["uri"].startswith("hf://")  # into the operator's cache
    assert not (spec.get("autoscaling") or {}).get("enabled")
    assert (spec.get("tuning") or {}).get("mode", "Off") == "Off"
    assert "prometheus" not in spec
    # One replica: the default StorageClass of a stock cluster is ReadWriteOnce.
    assert spec["replicas"] == 1 and "accessMode" not in spec["model"]["cache"]
    deployment = rendered_deployment(sample)
    pod = deployment["spec"]["template"]["spec"]
    resources = pod["containers"][0]["resources"]
    tensor_parallel = spec["engine"]["tensorParallelSize"]
    assert resources["limits"]["nvidia.com/gpu"] == tensor_parallel
    assert resources["requests"]["nvidia.com/gpu"] == tensor_parallel
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    ]
    assert claims == ["qwen2-5-7b-model-cache"]  # the cache the operator creates


def test_gpu_sample_is_a_7b_model_over_two_gpus() -> None:
    (sample,) = load_documents(MANIFESTS / "samples" / "llmdeployment-gpu.yaml")
    assert "7B" in sample["spec"]["model"]["name"]
    assert sample["spec"]["engine"]["tensorParallelSize"] == 2


def expected_reason(path: Path) -> str:
    first_line = path.read_text().splitlines()[0]
    assert first_line.startswith("# expect: "), f"{path.name} must state why it is invalid"
    return first_line.removeprefix("# expect: ")


@pytest.mark.parametrize("path", INVALID_SAMPLES, ids=lambda p: p.stem)
def test_invalid_samples_are_rejected_for_the_stated_reason(
    crd: dict[str, Any], path: Path
) -> None:
    (sample,) = load_documents(path)
    errors = validation_errors(crd, sample)
    reason = expected_reason(path)
    assert any(error.startswith(reason) for error in errors), f"expected {reason!r}, got {errors}"


def test_ngram_speculation_passes_with_tensor_parallelism(crd: dict[str, Any]) -> None:
    """Only the model-based methods need one GPU (the draft runs beside no shard): the
    invalid sample with method ngram and no draft is valid."""
    (sample,) = load_documents(
        Path(__file__).parent / "data" / "invalid" / "speculative-with-tensor-parallel.yaml")
    speculative = sample["spec"]["engine"]["speculative"]
    assert validation_errors(crd, sample)
    del speculative["draftModel"]
    speculative["method"] = "ngram"
    assert validation_errors(crd, sample) == []


def test_there_are_enough_invalid_samples() -> None:
    assert len(INVALID_SAMPLES) >= 15


def test_cpu_sample_requests_no_gpu() -> None:
    """The CPU sample schedules on a plain kind node: no nvidia.com/gpu request."""
    (sample,) = load_documents(MANIFESTS / "samples" / "llmdeployment-cpu.yaml")
    deployment = rendered_deployment(sample)
    resources = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert "nvidia.com/gpu" not in resources.get("limits", {})
    assert "nvidia.com/gpu" not in resources.get("requests", {})


def test_reserved_volume_names_are_the_operators(crd: dict[str, Any]) -> None:
    """The CRD's volume rule and the operator's own check refuse the same names."""
    from .apiserver.cel_ast import ListLiteral, parse

    spec = version_schema(crd)["properties"]["spec"]["properties"]
    (rule,) = spec["volumes"]["items"]["x-kubernetes-validations"]
    (names,) = [node for node in _walk(parse(rule["rule"])) if isinstance(node, ListLiteral)]
    reserved = [literal.value for literal in names.elements]
    assert reserved == ["model", "dshm", "engine-cache", "engine-tmp", "adapter-cache",
                        "draft-cache"]
    for name in [*reserved, "scratch"]:
        volume_spec = with_defaults({"model": {"name": "m"}, "volumes": [{"name": name}]})
        refused = any("spec.volumes" in error for error in validate_spec(volume_spec))
        assert refused is (name in reserved), name
        obj = {"apiVersion": "pagoda.dev/v1alpha1", "kind": "LLMDeployment",
               "metadata": {"name": "m"}, "spec": volume_spec}  # fmt: skip
        assert bool(validation_errors(crd, obj)) is (name in reserved), name


def _walk(node: Any) -> list[Any]:
    children = [value for value in vars(node).values() if hasattr(value, "__dataclass_fields__")]
    for value in vars(node).values():
        if isinstance(value, list):
            children += [item for item in value if hasattr(item, "__dataclass_fields__")]
    return [node] + [found for child in children for found in _walk(child)]
