"""The autoscaler backends as rendered: a KEDA ScaledObject (and TriggerAuthentication)
validated against KEDA's own CRD schemas, and an HPA validated against Kubernetes' schema
whose metric names the shipped prometheus-adapter rules really expose.

The KEDA CRDs in data/keda are vendored unchanged from kedacore/keda's config/crd/bases.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pagoda_operator.desired import desired_objects
from pagoda_operator.spec import validate_spec, with_defaults

from .conftest import MANIFESTS, load_documents
from .crd_schema import validation_errors
from .test_manifests import KUBERNETES_VERSIONS

KEDA_CRDS = Path(__file__).parent / "data" / "keda"
ADAPTER_VALUES = MANIFESTS / "autoscaling" / "prometheus-adapter-values.yaml"


def keda_crd(kind: str) -> dict[str, Any]:
    return load_documents(KEDA_CRDS / f"keda.sh_{kind.lower()}s.yaml")[0]


def gpu_sample(**autoscaling: Any) -> dict[str, Any]:
    (sample,) = load_documents(MANIFESTS / "samples" / "llmdeployment-gpu-autoscaled.yaml")
    sample["metadata"]["uid"] = "0f6f6b2e-1111-2222-3333-444455556666"
    sample["spec"]["autoscaling"].update(autoscaling)
    return sample


def owned(llmd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {obj["kind"]: obj for obj in desired_objects(llmd, service_monitor_api=False)}


def test_the_gpu_sample_scales_with_a_keda_scaled_object_valid_for_keda() -> None:
    objects = owned(gpu_sample(targetKVCacheUsage=0.85))
    assert "HorizontalPodAutoscaler" not in objects and "TriggerAuthentication" not in objects
    scaled = objects["ScaledObject"]
    assert validation_errors(keda_crd("ScaledObject"), scaled) == []
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "pagoda.dev/v1alpha1", "kind": "LLMDeployment", "name": "qwen2-5-7b",
    }  # fmt: skip
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 4)
    waiting, kv = spec["triggers"]
    assert waiting["type"] == "prometheus" and waiting["metricType"] == "AverageValue"
    assert waiting["metadata"] == {
        "serverAddress": "http://prometheus-operated.monitoring.svc:9090",
        "query": 'sum(vllm:num_requests_waiting{namespace="default",llmdeployment="qwen2-5-7b"})',
        "threshold": "8",
        "ignoreNullValues": "true",
    }
    assert kv["metadata"]["threshold"] == "0.85"
    assert kv["metadata"]["query"].startswith("sum(vllm:kv_cache_usage_perc{")


def test_prometheus_credentials_reach_keda_through_a_trigger_authentication() -> None:
    sample = gpu_sample()
    sample["spec"]["prometheus"].update(
        bearerTokenSecretRef={"name": "prometheus-token", "key": "token"},
        caSecretRef={"name": "prometheus-ca", "key": "ca.crt"},
    )
    objects = owned(sample)
    auth, scaled = objects["TriggerAuthentication"], objects["ScaledObject"]
    assert validation_errors(keda_crd("TriggerAuthentication"), auth) == []
    assert validation_errors(keda_crd("ScaledObject"), scaled) == []
    assert auth["spec"]["secretTargetRef"] == [
        {"parameter": "bearerToken", "name": "prometheus-token", "key": "token"},
        {"parameter": "ca", "name": "prometheus-ca", "key": "ca.crt"},
    ]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["authenticationRef"] == {"name": "qwen2-5-7b"}
    assert trigger["metadata"]["authModes"] == "bearer"
    # Before the ScaledObject that refers to it, so KEDA never sees a dangling reference.
    kinds = [obj["kind"] for obj in desired_objects(sample, service_monitor_api=False)]
    assert kinds.index("TriggerAuthentication") < kinds.index("ScaledObject")


def test_keda_needs_a_prometheus_url() -> None:
    spec = with_defaults(
        {"model": {"name": "m"}, "autoscaling": {"enabled": True, "backend": "KEDA"}}
    )
    assert validate_spec(spec) == [
        "spec.prometheus.url: required when spec.autoscaling.backend is KEDA"
    ]
    crd = load_documents(MANIFESTS / "crd.yaml")[0]
    llmd = {
        "apiVersion": "pagoda.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "m", "namespace": "default"},
        "spec": {"model": {"name": "m"}, "autoscaling": {"enabled": True, "backend": "KEDA"}},
    }
    assert any("autoscaling.backend is KEDA" in e for e in validation_errors(crd, llmd))


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_hpa_backend_is_valid_and_asks_for_what_the_adapter_rules_expose(
    version: str,
) -> None:
    hpa = owned(gpu_sample(backend="HPA", targetKVCacheUsage=0.85))["HorizontalPodAutoscaler"]
    kubernetes_validate.validate(hpa, version, strict=True)
    wanted = {metric["pods"]["metric"]["name"] for metric in hpa["spec"]["metrics"]}
    assert wanted == {"vllm_num_requests_waiting", "vllm_kv_cache_usage_perc"}
    assert wanted == set(adapter_metric_names())


def adapter_metric_names() -> dict[str, str]:
    """Custom-metrics name -> engine series, as prometheus-adapter names them."""
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]
    names = {}
    for rule in rules["custom"]:
        series = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{", rule["seriesQuery"])
        assert series is not None, rule["seriesQuery"]
        exposed = re.sub(rule["name"]["matches"], rule["name"]["as"], series.group(1))
        names[exposed] = series.group(1)
        assert rule["resources"]["overrides"] == {
            "namespace": {"resource": "namespace"}, "pod": {"resource": "pod"},
        }  # fmt: skip
    return names


def adapter_queries(namespace: str, pods: list[str]) -> dict[str, str]:
    """Each rule's metricsQuery as prometheus-adapter fills it in for an HPA's pods (it
    joins the pod names into one regex, as they are)."""
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    matchers = f'namespace="{namespace}",pod=~"{"|".join(pods)}"'
    queries = {}
    for (exposed, series), rule in zip(adapter_metric_names().items(), rules, strict=True):
        query = rule["metricsQuery"].replace("<<.Series>>", series)
        query = query.replace("<<.LabelMatchers>>", matchers).replace("<<.GroupBy>>", "pod")
        queries[exposed] = query
    return queries
