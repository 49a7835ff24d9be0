"""spec.routing.gateway: the InferencePool and endpoint picker the operator renders.

The InferencePool CRD in data/gateway-api-inference-extension is vendored unchanged from
kubernetes-sigs/gateway-api-inference-extension (config/crd/bases, the commit named in its
header); rendered pools are checked against it as the API server would check them
(crd_schema: defaults, structural schema, CEL rules).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pagoda_operator import constants as c
from pagoda_operator import gateway as gw
from pagoda_operator.desired import desired_objects
from pagoda_operator.diagnosis import Findings
from pagoda_operator.plan import object_key, plan_actions
from pagoda_operator.reconcile import ServedApis, gateway_problem, settled_objects
from pagoda_operator.spec import with_defaults
from pagoda_operator.status import needs_recheck, workload_status

from .conftest import MANIFESTS, load_documents
from .crd_schema import validation_errors

POOL_CRD = (
    Path(__file__).parent
    / "data"
    / "gateway-api-inference-extension"
    / "inference.networking.k8s.io_inferencepools.yaml"
)


def llmd(routing: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    body = {"model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, **spec}
    if routing is not None:
        body["routing"] = routing
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "metadata": {"name": "chat", "namespace": "llm", "uid": "uid-1", "generation": 1},
        "spec": body,
    }


def rendered(obj: dict[str, Any], **kwargs: Any) -> dict[tuple[str, str], dict[str, Any]]:
    objects = desired_objects(obj, service_monitor_api=False, **kwargs)
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


@pytest.fixture(scope="module")
def pool_crd() -> dict[str, Any]:
    (crd,) = load_documents(POOL_CRD)
    return crd


def test_no_gateway_objects_without_spec_routing_gateway() -> None:
    kinds = {kind for kind, _ in rendered(llmd())}
    assert kinds == {"Deployment", "Service"}


def test_the_pool_validates_against_the_extensions_crd(pool_crd: dict[str, Any]) -> None:
    for routing in ({"gateway": {}}, {"gateway": {"endpointPicker": {"failureMode": "FailOpen"}}}):
        pool = rendered(llmd(routing))[("InferencePool", "chat")]
        assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
        assert pool_crd["spec"]["versions"][0]["name"] == "v1"
        assert validation_errors(pool_crd, pool, version="v1") == []


def test_the_crd_check_refuses_what_the_api_server_would(pool_crd: dict[str, Any]) -> None:
    """The check bites: a pool without targetPorts, or with a port twice (a CEL rule)."""
    pool = rendered(llmd({"gateway": {}}))[("InferencePool", "chat")]
    no_ports = {**pool, "spec": {k: v for k, v in pool["spec"].items() if k != "targetPorts"}}
    assert validation_errors(pool_crd, no_ports, version="v1")
    twice = {**pool, "spec": {**pool["spec"], "targetPorts": [{"number": 8000}] * 2}}
    assert any("unique" in e for e in validation_errors(pool_crd, twice, version="v1"))


def test_the_pool_selects_the_engine_pods_on_their_port_and_never_the_picker() -> None:
    objects = rendered(llmd({"gateway": {}}, replicas=2))
    pool = objects[("InferencePool", "chat")]["spec"]
    engines = objects[("Deployment", "chat")]["spec"]["template"]
    picker = objects[("Deployment", "chat-epp")]["spec"]["template"]
    assert matches(pool["selector"]["matchLabels"], engines["metadata"]["labels"])
    assert not matches(pool["selector"]["matchLabels"], picker["metadata"]["labels"])
    ports = {p["containerPort"] for p in engines["spec"]["containers"][0]["ports"]}
    assert [p["number"] for p in pool["targetPorts"]] == [c.ENGINE_PORT]
    assert c.ENGINE_PORT in ports
    # Neither the engines' Service nor their disruption budget counts picker pods.
    engine_service = objects[("Service", "chat")]["spec"]["selector"]
    budget = objects[("PodDisruptionBudget", "chat")]["spec"]["selector"]["matchLabels"]
    assert not matches(engine_service, picker["metadata"]["labels"])
    assert not matches(budget, picker["metadata"]["labels"])


def test_the_pool_names_the_picker_service_and_its_grpc_port() -> None:
    objects = rendered(llmd({"gateway": {}}))
    ref = objects[("InferencePool", "chat")]["spec"]["endpointPickerRef"]
    service = objects[("Service", ref["name"])]["spec"]
    grpc = next(p for p in service["ports"] if p["port"] == ref["port"]["number"])
    assert grpc["appProtocol"] == "http2"  # ext-proc is gRPC
    assert ref["failureMode"] == "FailClose"
    picker = objects[("Deployment", ref["name"])]["spec"]["template"]
    assert matches(service["selector"], picker["metadata"]["labels"])
    container_ports = {p["containerPort"] for p in picker["spec"]["containers"][0]["ports"]}
    assert grpc["targetPort"] in container_ports


def test_the_picker_runs_as_the_extensions_chart_configures_it() -> None:
    objects = rendered(llmd({"gateway": {}}))
    pod = objects[("Deployment", "chat-epp")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert flags["--pool-name"] == "chat" and flags["--pool-namespace"] == "llm"
    assert flags["--pool-group"] == "inference.networking.k8s.io"
    # The plugins file is in the mounted ConfigMap.
    mount = container["volumeMounts"][0]
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config = objects[("ConfigMap", volume["configMap"]["name"])]
    assert flags["--config-file"] == f"{mount['mountPath']}/{gw.PLUGINS_FILE}"
    plugins = config["data"][gw.PLUGINS_FILE]
    for scorer in ("queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"):
        assert f"pluginRef: {scorer}" in plugins
    assert container["readinessProbe"]["grpc"]["port"] == gw.PICKER_HEALTH_PORT
    assert container["image"] == c.DEFAULT_PICKER_IMAGE
    # Its account may read what the picker watches.
    assert pod["serviceAccountName"] == "chat-epp"
    role = objects[("Role", "chat-epp")]
    binding = objects[("RoleBinding", "chat-epp")]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]
    rules = role["rules"]
    granted = {(g, r) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]}
    assert {("inference.networking.k8s.io", "inferencepools"), ("", "pods")} <= granted


def test_picker_image_comes_from_the_spec_then_the_operator_setting() -> None:
    own = {"gateway": {"endpointPicker": {"image": "mirror.local/epp:v1"}}}
    assert rendered(llmd(own))[("Deployment", "chat-epp")]["spec"]["template"]["spec"][
        "containers"
    ][0]["image"] == "mirror.local/epp:v1"
    objects = rendered(llmd({"gateway": {}}), picker_image="mirror.local/epp:v2")
    container = objects[("Deployment", "chat-epp")]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "mirror.local/epp:v2"


def test_every_gateway_object_is_owned_and_goes_when_the_gateway_does() -> None:
    with_gateway = desired_objects(llmd({"gateway": {}}), service_monitor_api=False)
    for obj in with_gateway:
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"], ref["controller"]) == (c.KIND, "uid-1", True)
    existing = {object_key(o): o for o in with_gateway}
    without = desired_objects(llmd(), service_monitor_api=False)
    deleted = {(a.kind, a.name) for a in plan_actions(without, existing, "uid-1")}
    assert deleted == {
        ("ServiceAccount", "chat-epp"),
        ("Role", "chat-epp"),
        ("RoleBinding", "chat-epp"),
        ("ConfigMap", "chat-epp"),
        ("Deployment", "chat-epp"),
        ("Service", "chat-epp"),
        ("InferencePool", "chat"),
    }


def test_without_the_inference_pool_api_the_engines_serve_and_the_status_says_why() -> None:
    obj = llmd({"gateway": {}})
    spec = with_defaults(obj["spec"])
    desired = desired_objects(obj, service_monitor_api=False)
    served = ServedApis(service_monitors=False, keda=False, inference_pools=False)
    settled, _ = settled_objects(desired, None, spec, served)
    assert {(o["kind"], o["metadata"]["name"]) for o in settled} == {
        ("Deployment", "chat"),
        ("Service", "chat"),
    }
    problem = gateway_problem(spec, pools_served=False)
    assert problem is not None and problem[0] == "MissingAPI"
    assert "InferencePool" in problem[1]
    status = workload_status(obj, None, "2025-01-01T00:00:00Z", findings=Findings(gateway=problem))
    ready = next(cond for cond in status["conditions"] if cond["type"] == "GatewayReady")
    assert (ready["status"], ready["reason"]) == ("False", "MissingAPI")
    # Rechecked periodically: installing the CRD changes no object the operator watches.
    assert needs_recheck({**obj, "status": {**status, "phase": "Available"}})
    assert gateway_problem(spec, pools_served=True) is None
    assert gateway_problem(with_defaults(llmd()["spec"]), pools_served=False) is None


def test_the_gateway_sample_renders_a_valid_pool(pool_crd: dict[str, Any]) -> None:
    (sample,) = load_documents(MANIFESTS / "samples" / "llmdeployment-gateway.yaml")
    sample["metadata"]["uid"] = "uid-1"
    objects = rendered(sample)
    pool = objects[("InferencePool", "smollm2")]
    assert validation_errors(pool_crd, pool, version="v1") == []
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
