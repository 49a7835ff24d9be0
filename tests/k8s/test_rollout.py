"""Rollouts that work on a full GPU cluster, drains that finish in-flight requests, probes
that wait for the model, and the disruption budget: pure desired-object tests."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from pagoda_operator import constants as c
from pagoda_operator.desired import desired_objects
from pagoda_operator.plan import parse_flags
from pagoda_operator.spec import validate_spec, with_defaults

from .crd_schema import validation_errors
from .test_manifests import KUBERNETES_VERSIONS


def llmd(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "metadata": {"name": "qwen", "namespace": "ml", "uid": "uid-1", "generation": 1},
        "spec": {"model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, **spec},
    }


def objects(**spec: Any) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in desired_objects(llmd(**spec), service_monitor_api=False)}


def deployment_spec(**spec: Any) -> dict[str, Any]:
    return objects(**spec)["Deployment"]["spec"]


def test_default_rollout_needs_no_spare_gpu() -> None:
    # A surge pod would wait for a free GPU that a full cluster does not have.
    assert deployment_spec(replicas=4)["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }


@pytest.mark.parametrize(
    ("rollout", "strategy"),
    [
        ({"maxSurge": 1}, {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}),
        ({"maxSurge": 2, "maxUnavailable": 1}, {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 2, "maxUnavailable": 1}}),
        ({"strategy": "Recreate"}, {"type": "Recreate"}),
    ],
)  # fmt: skip
def test_rollout_strategy_from_the_spec(rollout: dict[str, Any], strategy: dict[str, Any]) -> None:
    assert deployment_spec(rollout=rollout)["strategy"] == strategy


def test_graceful_termination_defaults() -> None:
    pod = deployment_spec()["template"]["spec"]
    container = pod["containers"][0]
    assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": 10}}}
    assert parse_flags(container["args"])["--shutdown-grace-seconds"] == "120"
    # Long generations are not cut at Kubernetes' default 30 s.
    assert pod["terminationGracePeriodSeconds"] == 150 >= 10 + 120


def test_termination_settings() -> None:
    termination = {"preStopSeconds": 0, "drainSeconds": 600, "terminationGracePeriodSeconds": 620}
    pod = deployment_spec(termination=termination)["template"]["spec"]
    assert "lifecycle" not in pod["containers"][0]
    assert pod["terminationGracePeriodSeconds"] == 620
    assert parse_flags(pod["containers"][0]["args"])["--shutdown-grace-seconds"] == "600"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"termination": {"drainSeconds": 300}}, "terminationGracePeriodSeconds must be >= preStopSeconds + drainSeconds"),
        ({"rollout": {"strategy": "Recreate", "maxSurge": 1}}, "go with the RollingUpdate strategy"),
        ({"rollout": {"maxSurge": 0, "maxUnavailable": 0}}, "cannot both be 0"),
        ({"disruptionBudget": {"minAvailable": 1, "maxUnavailable": 1}}, "not both"),
    ],
)  # fmt: skip
def test_crd_and_operator_refuse_wedging_settings(
    crd: dict[str, Any], spec: dict[str, Any], message: str
) -> None:
    obj = llmd(**spec)
    assert any(message in error for error in validation_errors(crd, obj)), validation_errors(
        crd, obj
    )
    assert any(message in error for error in validate_spec(with_defaults(obj["spec"])))


def test_startup_probe_fails_until_the_model_is_loaded() -> None:
    container = deployment_spec()["template"]["spec"]["containers"][0]
    # /health answers 200 while the model loads; /ready only once it is loaded and warm.
    assert container["startupProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"


def test_disruption_budget_choices() -> None:
    assert "PodDisruptionBudget" not in objects(replicas=1)
    assert objects(replicas=3)["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1
    # Asked for availability: a drain waits until another replica is ready.
    pdb = objects(replicas=1, disruptionBudget={"minAvailable": 1})["PodDisruptionBudget"]
    assert pdb["spec"]["minAvailable"] == 1 and "maxUnavailable" not in pdb["spec"]


def test_pvc_read_only_false_is_honoured() -> None:
    model = {"name": "m", "source": {"pvc": {"claimName": "w", "readOnly": False}}}
    pod = deployment_spec(model=model)["template"]["spec"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "model"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
    assert mount["readOnly"] is False
    assert volume["persistentVolumeClaim"]["readOnly"] is False


def test_pod_template_fields(crd: dict[str, Any]) -> None:
    spread = [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"pagoda.dev/llmdeployment": "qwen"}},
        }
    ]
    spec = {
        "topologySpreadConstraints": spread,
        "priorityClassName": "inference-high",
        "podLabels": {"team": "ml", "app.kubernetes.io/name": "mine"},
        "podAnnotations": {"sidecar.istio.io/inject": "false"},
        "service": {
            "annotations": {"service.beta.kubernetes.io/aws-load-balancer-internal": "true"}
        },
        "volumes": [{"name": "lora", "configMap": {"name": "adapters"}}],
        "volumeMounts": [{"name": "lora", "mountPath": "/adapters", "readOnly": True}],
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
    }
    assert validation_errors(crd, llmd(**spec)) == []
    owned = objects(**spec)
    template = owned["Deployment"]["spec"]["template"]
    pod = template["spec"]
    assert pod["topologySpreadConstraints"] == spread
    assert pod["priorityClassName"] == "inference-high"
    assert template["metadata"]["labels"]["team"] == "ml"
    # The selector's labels are the operator's: a pod label cannot take the pod out of it.
    assert template["metadata"]["labels"]["app.kubernetes.io/name"] == "pagoda-engine"
    assert template["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    assert {"name": "lora", "configMap": {"name": "adapters"}} in pod["volumes"]
    container = pod["containers"][0]
    assert {"name": "lora", "mountPath": "/adapters", "readOnly": True} in container["volumeMounts"]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"]
    annotations = owned["Service"]["metadata"]["annotations"]
    assert annotations["service.beta.kubernetes.io/aws-load-balancer-internal"] == "true"
    for version in KUBERNETES_VERSIONS:
        for obj in owned.values():
            kubernetes_validate.validate(obj, version, strict=True)


def test_operator_volume_names_are_reserved(crd: dict[str, Any]) -> None:
    obj = llmd(volumes=[{"name": "model", "emptyDir": {}}])
    assert any("operator's" in e for e in validation_errors(crd, obj))
    assert any("operator's" in e for e in validate_spec(with_defaults(obj["spec"])))


def test_each_condition_says_which_generation_it_observed() -> None:
    from pagoda_operator.status import spec_problem_status, workload_status

    obj = llmd()
    obj["metadata"]["generation"] = 7
    status = workload_status(obj, None, "2025-01-01T00:00:00Z")
    assert {cond["observedGeneration"] for cond in status["conditions"]} == {7}
    # An update held back (the new weights are still loading) is not reported as observed.
    held = workload_status(obj, None, "2025-01-01T00:00:00Z", applied_generation=6)
    assert held["observedGeneration"] == 6
    assert {cond["observedGeneration"] for cond in held["conditions"]} == {6}
    # A spec verdict is about the new generation; what served keeps the generation it saw.
    obj["status"] = held
    obj["metadata"]["generation"] = 8
    problem = spec_problem_status(obj, "InvalidSpec", "bad", "2025-01-01T00:01:00Z")
    by_type = {cond["type"]: cond["observedGeneration"] for cond in problem["conditions"]}
    assert by_type == {"Available": 6, "Progressing": 6, "Degraded": 8}
