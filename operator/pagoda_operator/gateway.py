"""The Gateway API inference extension's objects for one LLMDeployment (``spec.routing.gateway``).

An ``InferencePool`` selects the engine pods and names an endpoint picker (EPP), the
extension's own component, which scrapes the engines' ``/metrics`` (vLLM names, which
pagoda's server keeps: tests/k8s/test_gateway_protocol.py) and tells the Gateway which pod
each request goes to: shortest queue, lowest KV-cache use, longest cached prefix. The
picker is configured as the extension's ``inferencepool`` Helm chart configures it
(config/charts/inferencepool: its Deployment's flags and ports, its Role, its default
``EndpointPickerConfig``); ``desired_gateway`` gives the spec bodies their metadata.
"""

from __future__ import annotations

import copy
from typing import Any

from pagoda_operator import constants as c
from pagoda_operator.metadata import common_labels, finish, selector_labels

POOL_API_VERSION = "inference.networking.k8s.io/v1"
POOL_GROUP = POOL_API_VERSION.split("/")[0]
# The picker's gRPC (ext-proc) port, its gRPC health port and its metrics port: the chart's.
PICKER_GRPC_PORT = 9002
PICKER_HEALTH_PORT = 9003
PICKER_METRICS_PORT = 9090
PICKER_APP_NAME = "pagoda-endpoint-picker"
PLUGINS_FILE = "default-plugins.yaml"
CONFIG_MOUNT = "/config"
CONFIG_VOLUME = "plugins-config"
PICKER_USER_ID = 65532

# The chart's default scheduling profile: queue depth and KV-cache use weighted 2, the
# prefix-cache match 3; the picker scores every endpoint and takes the best.
PLUGINS_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
"""


def gateway_spec(spec: dict[str, Any]) -> dict[str, Any] | None:
    """``spec.routing.gateway`` with its defaults; None when the gateway path is off."""
    gateway = (spec.get("routing") or {}).get("gateway")
    if gateway is None:
        return None
    result = copy.deepcopy(gateway)
    picker = result.setdefault("endpointPicker", {})
    picker.setdefault("failureMode", "FailClose")
    return result


def picker_name(name: str) -> str:
    """The picker's Deployment, Service, ConfigMap, ServiceAccount, Role and RoleBinding."""
    return f"{name}-epp"


def picker_selector(name: str) -> dict[str, str]:
    """Disjoint from the engines' selector (another app name), so neither the engine
    Service nor the InferencePool ever selects a picker pod."""
    return {c.LABEL_NAME: PICKER_APP_NAME, c.LABEL_OWNER: name}


def pool_body(name: str, engine_selector: dict[str, str], gateway: dict[str, Any]) -> dict:
    return {
        "spec": {
            "selector": {"matchLabels": dict(engine_selector)},
            "targetPorts": [{"number": c.ENGINE_PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": picker_name(name),
                "port": {"number": PICKER_GRPC_PORT},
                "failureMode": gateway["endpointPicker"]["failureMode"],
            },
        }
    }


def picker_config_body() -> dict[str, Any]:
    return {"data": {PLUGINS_FILE: PLUGINS_CONFIG}}


def picker_role_body() -> dict[str, Any]:
    """What the picker reads: its pool, the pool's pods, and the objectives and model
    rewrites of the extension's experimental group (it watches them when installed)."""
    read = ["get", "list", "watch"]
    return {
        "rules": [
            {"apiGroups": [POOL_GROUP], "resources": ["inferencepools"], "verbs": read},
            {
                "apiGroups": ["inference.networking.x-k8s.io"],
                "resources": ["inferenceobjectives", "inferencemodelrewrites"],
                "verbs": read,
            },
            {"apiGroups": [""], "resources": ["pods"], "verbs": read},
        ]
    }


def picker_role_binding_body(name: str, namespace: str) -> dict[str, Any]:
    account = picker_name(name)
    return {
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}],
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
    }


def picker_service_body(name: str) -> dict[str, Any]:
    return {
        "spec": {
            "type": "ClusterIP",
            "selector": picker_selector(name),
            "ports": [
                # The Gateway speaks ext-proc (gRPC) to the picker: HTTP/2 end to end.
                {"name": "grpc-ext-proc", "port": PICKER_GRPC_PORT, "protocol": "TCP",
                 "targetPort": PICKER_GRPC_PORT, "appProtocol": "http2"},
                {"name": "http-metrics", "port": PICKER_METRICS_PORT, "protocol": "TCP",
                 "targetPort": PICKER_METRICS_PORT},
            ],  # fmt: skip
        }
    }


def picker_deployment_body(
    name: str, namespace: str, gateway: dict[str, Any], image: str, pod_labels: dict[str, str]
) -> dict[str, Any]:
    picker = gateway["endpointPicker"]
    container: dict[str, Any] = {
        "name": "epp",
        "image": picker.get("image") or image,
        "imagePullPolicy": "IfNotPresent",
        "args": picker_args(name, namespace),
        "ports": [
            {"name": "grpc", "containerPort": PICKER_GRPC_PORT},
            {"name": "grpc-health", "containerPort": PICKER_HEALTH_PORT},
            {"name": "metrics", "containerPort": PICKER_METRICS_PORT},
        ],
        "env": [
            {"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "livenessProbe": {**_grpc_health(), "initialDelaySeconds": 5, "periodSeconds": 10},
        "readinessProbe": {**_grpc_health(), "periodSeconds": 2},
        "volumeMounts": [{"name": CONFIG_VOLUME, "mountPath": CONFIG_MOUNT}],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            # The picker image's own user (distroless nonroot), stated so that
            # runAsNonRoot can be checked by the kubelet.
            "runAsNonRoot": True,
            "runAsUser": PICKER_USER_ID,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if picker.get("resources"):
        container["resources"] = copy.deepcopy(picker["resources"])
    return {
        "spec": {
            "replicas": 1,
            # One active picker: its prefix index lives in memory, and a rolling update
            # would run two that disagree (the chart's reason for Recreate).
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": picker_selector(name)},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "serviceAccountName": picker_name(name),
                    # As long as the engines' own grace period: requests in flight finish.
                    "terminationGracePeriodSeconds": 130,
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                    "volumes": [
                        {"name": CONFIG_VOLUME, "configMap": {"name": picker_name(name)}}
                    ],
                },
            },
        }
    }


def picker_args(name: str, namespace: str) -> list[str]:
    """The chart's flags for a picker of one InferencePool (vLLM metric names are the
    picker's defaults, and pagoda's)."""
    return [
        "--pool-name", name,
        "--pool-namespace", namespace,
        "--pool-group", POOL_GROUP,
        "--zap-encoder", "json",
        "--config-file", f"{CONFIG_MOUNT}/{PLUGINS_FILE}",
        "--grpc-port", str(PICKER_GRPC_PORT),
        "--grpc-health-port", str(PICKER_HEALTH_PORT),
    ]  # fmt: skip


def _grpc_health() -> dict[str, Any]:
    return {"grpc": {"port": PICKER_HEALTH_PORT, "service": "inference-extension"}}


def desired_gateway(
    llmd: dict[str, Any], gateway: dict[str, Any], picker_image: str
) -> list[dict[str, Any]]:
    """The InferencePool and its endpoint picker (see ``gateway``): the picker's RBAC and
    configuration before the Deployment that needs them."""
    name, namespace = llmd["metadata"]["name"], llmd["metadata"]["namespace"]
    picker = picker_name(name)
    labels = {**common_labels(name), **picker_selector(name), c.LABEL_COMPONENT: "router"}
    rbac = "rbac.authorization.k8s.io/v1"

    def picker_object(api_version: str, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        return finish(llmd, api_version, kind, body, picker, labels=labels)

    return [
        picker_object("v1", "ServiceAccount", {"automountServiceAccountToken": True}),
        picker_object(rbac, "Role", picker_role_body()),
        picker_object(rbac, "RoleBinding", picker_role_binding_body(name, namespace)),
        picker_object("v1", "ConfigMap", picker_config_body()),
        picker_object(
            "apps/v1",
            "Deployment",
            picker_deployment_body(name, namespace, gateway, picker_image, labels),
        ),
        picker_object("v1", "Service", picker_service_body(name)),
        finish(llmd, POOL_API_VERSION, "InferencePool",
               pool_body(name, selector_labels(name), gateway)),
    ]  # fmt: skip
