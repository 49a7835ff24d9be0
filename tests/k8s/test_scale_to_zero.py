"""autoscaling.minReplicas 0: the KEDA ScaledObject that scales the engines to zero after an
idle time and back when pagoda router holds a request, the CRD's rules about it, and the
cold start the status records."""

from __future__ import annotations

from typing import Any

from pagoda_operator.spec import validate_spec, with_defaults
from pagoda_operator.status import cold_start, workload_status

from .conftest import MANIFESTS, load_documents
from .crd_schema import validation_errors
from .test_autoscalers import gpu_sample, keda_crd, owned


def llmd(autoscaling: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "pagoda.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "m", "namespace": "default"},
        "spec": {"model": {"name": "m"}, "autoscaling": autoscaling,
                 "prometheus": {"url": "http://prometheus:9090"}},
    }  # fmt: skip


def test_zero_replicas_scale_on_demand_with_a_keda_scaled_object_valid_for_keda() -> None:
    sample = gpu_sample(minReplicas=0, idleTimeoutSeconds=600)
    scaled = owned(sample)["ScaledObject"]
    assert validation_errors(keda_crd("ScaledObject"), scaled) == []
    spec = scaled["spec"]
    assert (spec["minReplicaCount"], spec["cooldownPeriod"]) == (0, 600)
    demand = spec["triggers"][-1]
    assert demand["name"] == "demand" and demand["metadata"]["activationThreshold"] == "0"
    query = demand["metadata"]["query"]
    model = sample["spec"]["model"].get("servedModelName") or sample["spec"]["model"]["name"]
    # The router's gauge for this model (requests held while no engine is up), and the
    # engines' running requests (so an engine serving a long answer is not idle).
    assert f'pagoda_router_held_requests{{namespace="default",model="{model}"}}' in query
    assert 'vllm:num_requests_running{namespace="default",llmdeployment="qwen2-5-7b"}' in query
    assert "or vector(0)" in query  # an absent series is 0, not a failed query
    assert "cooldownPeriod" not in owned(gpu_sample())["ScaledObject"]["spec"]


def test_zero_replicas_need_the_keda_backend() -> None:
    crd = load_documents(MANIFESTS / "crd.yaml")[0]
    keda = llmd({"enabled": True, "backend": "KEDA", "minReplicas": 0, "maxReplicas": 2})
    hpa = llmd({"enabled": True, "backend": "HPA", "minReplicas": 0, "maxReplicas": 2})
    assert validation_errors(crd, keda) == []
    assert any("KEDA backend" in e for e in validation_errors(crd, hpa))
    assert validate_spec(with_defaults(keda["spec"])) == []
    assert any("KEDA backend" in e for e in validate_spec(with_defaults(hpa["spec"])))
    short = llmd({"enabled": True, "backend": "KEDA", "minReplicas": 0, "idleTimeoutSeconds": 5})
    assert validation_errors(crd, short)  # under 30 s would flap on every pause


def test_a_start_from_zero_is_timed_in_the_status() -> None:
    started = cold_start(None, "ScaledToZero", desired=1, ready=0, now="2025-01-01T00:00:00Z")
    assert started == {"startedAt": "2025-01-01T00:00:00Z"}
    waiting = cold_start(started, "Progressing", 1, 0, "2025-01-01T00:01:00Z")
    assert waiting == started
    done = cold_start(waiting, "Progressing", 1, 1, "2025-01-01T00:02:30Z")
    assert done == {"startedAt": None, "lastSeconds": 150.0, "lastReadyAt": "2025-01-01T00:02:30Z"}
    # Settled: the record stays, and nothing starts again while replicas serve.
    assert cold_start(done, "Available", 1, 1, "2025-01-01T00:05:00Z") == {
        "lastSeconds": 150.0, "lastReadyAt": "2025-01-01T00:02:30Z",
    }  # fmt: skip
    assert cold_start(None, "Available", 2, 1, "2025-01-01T00:00:00Z") is None


def test_workload_status_carries_the_cold_start() -> None:
    obj = llmd({"enabled": True, "backend": "KEDA", "minReplicas": 0, "maxReplicas": 2})
    obj["spec"]["replicas"] = 1
    obj["metadata"].update(uid="u", generation=2)
    obj["status"] = {"phase": "ScaledToZero"}
    status = workload_status(obj, None, "2025-01-01T00:00:00Z")
    assert status["coldStart"] == {"startedAt": "2025-01-01T00:00:00Z"}
