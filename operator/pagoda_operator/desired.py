"""The objects an LLMDeployment should own, as plain dicts: LLMDeployment in, manifests out
(each with its config hash: see ``metadata``)."""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from pagoda_operator import constants as c
from pagoda_operator import gateway as gw
from pagoda_operator.adapters import (
    ADAPTER_VOLUME,
    ADAPTERS_FOLDER,
    ADAPTERS_MOUNT_PATH,
    downloaded_adapters,
    lora_enabled,
)
from pagoda_operator.autoscalers import (
    desired_autoscaler,
    desired_scaled_object,
    desired_trigger_authentication,
    prometheus_auth,
)
from pagoda_operator.draft_model import (
    DRAFT_FOLDER,
    DRAFT_MOUNT_PATH,
    DRAFT_VOLUME,
    downloaded_draft,
)
from pagoda_operator.engine_args import API_KEY_ENV, gpu_count, serve_args
from pagoda_operator.live_adapters import startup_adapters
from pagoda_operator.live_settings import (
    ADMIN_PORT,
    ADMIN_PORT_NAME,
    SETTINGS_ANNOTATION,
    admin_enabled,
    config_map_data,
    live_enabled,
    restart_hash,
    settings_config_map_name,
)
from pagoda_operator.live_settings import env_entries as live_env_entries
from pagoda_operator.metadata import (
    common_labels,
    finish,
    selector_labels,
)
from pagoda_operator.model_cache import (
    KERNEL_CACHE_FOLDER,
    cache_claim_body,
    cache_claim_name,
    cache_folder,
    loader_job_body,
    loader_job_name,
    needs_cache,
)
from pagoda_operator.overrides import effective_spec
from pagoda_operator.spec import model_source, with_defaults

MODEL_VOLUME = "model"
SHM_VOLUME = "dshm"
CACHE_VOLUME = "engine-cache"
TMP_VOLUME = "engine-tmp"
# Triton's kernels and launchers, the CUDA JIT cache and, for the embedded default model on
# the GPU image, its converted weights (~0.5 GB); over the limit the kubelet evicts the pod.
CACHE_SIZE_LIMIT = "8Gi"
TMP_SIZE_LIMIT = "2Gi"
STARTUP_PROBE_PERIOD_SECONDS = 10


@dataclass(frozen=True)
class MonitorSettings:
    """What the operator's ServiceMonitors carry besides their own labels."""

    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    interval: str = c.DEFAULT_SCRAPE_INTERVAL


DEFAULT_MONITOR = MonitorSettings()


def desired_objects(
    llmd: dict[str, Any],
    *,
    service_monitor_api: bool,
    default_image: str = c.DEFAULT_ENGINE_IMAGE,
    model_cached: bool = True,
    monitor: MonitorSettings = DEFAULT_MONITOR,
    picker_image: str = c.DEFAULT_PICKER_IMAGE,
) -> list[dict[str, Any]]:
    """Everything this LLMDeployment should own right now, in the order to apply it: its
    spec with the tuner's overrides in force (see ``overrides``).

    ``model_cached``: whether the model cache (hf:// and s3:// sources) holds the weights;
    until it does, the Deployment runs no replicas, whatever the tuner's replica override.
    """
    spec = effective_spec(llmd)
    objects = []
    if needs_cache(spec):
        objects += desired_model_cache(llmd, spec, default_image, replicas_ceiling(llmd))
    if admin_enabled(spec):  # before the Deployment, whose pods read it
        objects.append(desired_settings_config_map(llmd, spec, model_cached=model_cached))
    objects += [
        desired_deployment(llmd, spec, default_image, model_cached=model_cached),
        desired_service(llmd, spec),
    ]
    budget = disruption_budget(spec)
    if budget is not None:
        objects.append(desired_pod_disruption_budget(llmd, budget))
    if spec["autoscaling"]["enabled"]:
        if spec["autoscaling"]["backend"] == "KEDA":
            if prometheus_auth(spec):
                objects.append(desired_trigger_authentication(llmd, spec))
            objects.append(desired_scaled_object(llmd, spec))
        else:
            objects.append(desired_autoscaler(llmd, spec))
    if service_monitor_api:
        objects.append(desired_service_monitor(llmd, monitor))
    gateway = gw.gateway_spec(spec)
    if gateway is not None:
        objects += gw.desired_gateway(llmd, gateway, picker_image)
    return objects


def effective_replicas(spec: dict[str, Any]) -> int:
    """spec.replicas, held inside the autoscaling bounds when autoscaling is on."""
    replicas = int(spec["replicas"])
    autoscaling = spec["autoscaling"]
    if autoscaling["enabled"]:
        return min(max(replicas, autoscaling["minReplicas"]), autoscaling["maxReplicas"])
    return replicas


def effective_max_replicas(spec: dict[str, Any]) -> int:
    autoscaling = spec["autoscaling"]
    return autoscaling["maxReplicas"] if autoscaling["enabled"] else int(spec["replicas"])


def replicas_ceiling(llmd: dict[str, Any]) -> int:
    """The most replicas the user's spec lets run: the autoscaler's maximum, or the tuner's
    when it may move replicas (mode Auto, not pinned), else spec.replicas. Taken from the spec
    without the tuner's overrides, so an override never asks for a different cache access
    mode (a claim's accessModes cannot change)."""
    spec = with_defaults(llmd.get("spec") or {})
    tuning = spec["tuning"]
    tuned = tuning["mode"] == "Auto" and "replicas" not in (tuning.get("pinned") or [])
    if tuned:
        return max(effective_max_replicas(spec), int(spec["autoscaling"]["maxReplicas"]))
    return effective_max_replicas(spec)


def rollout_strategy(spec: dict[str, Any]) -> dict[str, Any]:
    """By default one replica at a time is stopped before its successor starts (maxSurge 0,
    maxUnavailable 1): a surge needs GPUs that a full cluster does not have, and a surge pod
    left Pending holds the rollout until its progress deadline."""
    rollout = spec["rollout"]
    if rollout["strategy"] == "Recreate":
        return {"type": "Recreate"}
    surge = int(rollout.get("maxSurge") or 0)
    unavailable = rollout.get("maxUnavailable")
    if unavailable is None:
        unavailable = 0 if surge > 0 else 1
    return {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": surge, "maxUnavailable": int(unavailable)},
    }


def desired_model_cache(
    llmd: dict[str, Any], spec: dict[str, Any], default_image: str, max_replicas: int
) -> list[dict[str, Any]]:
    """The cache volume and the Job that fills it (see model_cache.py)."""
    name = llmd["metadata"]["name"]
    claim = cache_claim_body(spec, max_replicas)
    job = loader_job_body(
        name,
        spec,
        spec.get("image") or default_image,
        pod_security_context(),
        container_security_context(),
    )
    return [
        finish(llmd, "v1", "PersistentVolumeClaim", claim, cache_claim_name(name)),
        finish(llmd, "batch/v1", "Job", job, loader_job_name(name)),
    ]


def desired_deployment(
    llmd: dict[str, Any], spec: dict[str, Any], default_image: str, *, model_cached: bool = True
) -> dict:
    name = llmd["metadata"]["name"]
    startup_timeout = int(spec["startupTimeoutSeconds"])
    body = {
        "spec": {
            "replicas": effective_replicas(spec) if model_cached else 0,
            "selector": {"matchLabels": selector_labels(name)},
            "strategy": rollout_strategy(spec),
            "progressDeadlineSeconds": startup_timeout + 600,
            "template": {
                "metadata": {
                    "labels": {**(spec.get("podLabels") or {}), **common_labels(name)},
                    "annotations": {
                        **(spec.get("podAnnotations") or {}),
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(c.ENGINE_PORT),
                        "prometheus.io/path": c.METRICS_PATH,
                    },
                },
                "spec": pod_spec(name, spec, default_image),
            },
        }
    }
    if live_enabled(spec):
        annotations = body["spec"]["template"]["metadata"]["annotations"]
        annotations[SETTINGS_ANNOTATION] = restart_hash(llmd, spec)
    return finish(llmd, "apps/v1", "Deployment", body)


def desired_settings_config_map(
    llmd: dict[str, Any], spec: dict[str, Any], *, model_cached: bool = True
) -> dict[str, Any]:
    """The live knobs' values in force and the adapters to serve, which the engines' flags
    read when they start (``model_cached``: whether the cache holds every adapter)."""
    name = settings_config_map_name(llmd["metadata"]["name"])
    data = config_map_data(spec, startup_adapters(llmd, spec, delivered=model_cached))
    return finish(llmd, "v1", "ConfigMap", {"data": data}, name)


def pod_spec(name: str, spec: dict[str, Any], default_image: str) -> dict[str, Any]:
    pod: dict[str, Any] = {
        # The engine never talks to the Kubernetes API.
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": int(spec["termination"]["terminationGracePeriodSeconds"]),
        "securityContext": pod_security_context(),
        "containers": [engine_container(name, spec, default_image)],
        "volumes": volumes(name, spec),
    }
    for field in (
        "nodeSelector",
        "tolerations",
        "affinity",
        "runtimeClassName",
        "topologySpreadConstraints",
        "priorityClassName",
    ):
        if spec.get(field):
            pod[field] = copy.deepcopy(spec[field])
    pod["volumes"] += copy.deepcopy(spec.get("volumes") or [])
    if spec.get("imagePullSecrets"):
        pod["imagePullSecrets"] = copy.deepcopy(spec["imagePullSecrets"])
    return pod


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": c.ENGINE_USER_ID,
        "runAsGroup": c.ENGINE_USER_ID,
        "fsGroup": c.ENGINE_USER_ID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    # Read-only root: the engine writes only to its emptyDirs (see volumes).
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def engine_container(name: str, spec: dict[str, Any], default_image: str) -> dict[str, Any]:
    ports = [{"name": c.ENGINE_PORT_NAME, "containerPort": c.ENGINE_PORT, "protocol": "TCP"}]
    env = engine_env(spec)
    if admin_enabled(spec):  # the admin API: the tuner's live changes, adapters (``live_settings``)
        ports.append({"name": ADMIN_PORT_NAME, "containerPort": ADMIN_PORT, "protocol": "TCP"})
        env = env[:1] + live_env_entries(name, spec) + env[1:]
    container: dict[str, Any] = {
        "name": "engine",
        "image": spec.get("image") or default_image,
        "command": ["pagoda"],
        "args": serve_args(spec),
        "ports": ports,
        "env": env,
        "resources": container_resources(spec),
        "volumeMounts": volume_mounts(spec) + copy.deepcopy(spec.get("volumeMounts") or []),
        "securityContext": container_security_context(),
        **probes(int(spec["startupTimeoutSeconds"])),
    }
    pre_stop = int(spec["termination"]["preStopSeconds"])
    if pre_stop:
        # Endpoints drop a terminating pod asynchronously: keep serving meanwhile, so no
        # request is sent to a closed port. SIGTERM (and the drain) come after the sleep.
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": pre_stop}}}
    if spec.get("imagePullPolicy"):
        container["imagePullPolicy"] = spec["imagePullPolicy"]
    return container


def probes(startup_timeout_seconds: int) -> dict[str, Any]:
    """Startup allows a whole model load and fails until the model is loaded and warmed up
    (``/ready``; ``/health`` answers while loading), so a hung load is restarted once
    ``startupTimeoutSeconds`` is spent. After that, liveness only catches a wedged process."""

    def http_get(path: str) -> dict[str, Any]:
        return {"path": path, "port": c.ENGINE_PORT_NAME}

    return {
        "startupProbe": {
            "httpGet": http_get(c.READY_PATH),
            "periodSeconds": STARTUP_PROBE_PERIOD_SECONDS,
            "timeoutSeconds": 5,
            "failureThreshold": math.ceil(startup_timeout_seconds / STARTUP_PROBE_PERIOD_SECONDS),
        },
        "readinessProbe": {
            "httpGet": http_get(c.READY_PATH),
            "periodSeconds": 5,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": http_get(c.HEALTH_PATH),
            "periodSeconds": 15,
            "timeoutSeconds": 10,
            "failureThreshold": 4,
        },
    }


def engine_env(spec: dict[str, Any]) -> list[dict[str, Any]]:
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    secret_ref = spec["engine"].get("apiKeySecretRef")
    if secret_ref:
        env.append(
            {
                "name": API_KEY_ENV,
                "valueFrom": {
                    "secretKeyRef": {"name": secret_ref["name"], "key": secret_ref["key"]}
                },
            }
        )
    env += copy.deepcopy(spec.get("env") or [])
    return env


def container_resources(spec: dict[str, Any]) -> dict[str, Any]:
    resources = copy.deepcopy(spec.get("resources") or {})
    gpus = gpu_count(spec)
    if gpus:
        # Extended resources must have requests equal to limits.
        resources.setdefault("limits", {})[c.GPU_RESOURCE] = gpus
        resources.setdefault("requests", {})[c.GPU_RESOURCE] = gpus
    return resources


def shm_size(spec: dict[str, Any]) -> str:
    """NCCL moves tensors between ranks through /dev/shm; one rank needs little of it."""
    explicit = spec["engine"].get("shmSize")
    if explicit:
        return str(explicit)
    return "1Gi" if spec["engine"]["tensorParallelSize"] == 1 else "16Gi"


def volumes(name: str, spec: dict[str, Any]) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = [
        {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": shm_size(spec)}},
        {"name": CACHE_VOLUME, "emptyDir": {"sizeLimit": CACHE_SIZE_LIMIT}},
        {"name": TMP_VOLUME, "emptyDir": {"sizeLimit": TMP_SIZE_LIMIT}},
    ]
    kind, source = model_source(spec)
    if kind == "pvc":
        result.append(
            {
                "name": MODEL_VOLUME,
                "persistentVolumeClaim": {
                    "claimName": source["claimName"],
                    "readOnly": source.get("readOnly", True),
                },
            }
        )
    elif kind == "hostPath":
        result.append(
            {
                "name": MODEL_VOLUME,
                "hostPath": {"path": source["path"], "type": source.get("type", "Directory")},
            }
        )
    elif kind == "download":
        # Writable as a volume: the weights' mount is read-only, the kernel cache's is not.
        claim = {"claimName": cache_claim_name(name)}
        result.append({"name": MODEL_VOLUME, "persistentVolumeClaim": claim})
    if kind != "download" and (adapters_mounted(spec) or downloaded_draft(spec)):
        # Adapters or a draft in the cache of a model that is not: the claim once more.
        claim = {"claimName": cache_claim_name(name), "readOnly": True}
        result.append({"name": cache_volume(spec), "persistentVolumeClaim": claim})
    return result


def volume_mounts(spec: dict[str, Any]) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [
        {"name": SHM_VOLUME, "mountPath": "/dev/shm"},
        {"name": CACHE_VOLUME, "mountPath": c.ENGINE_CACHE_PATH},
        {"name": TMP_VOLUME, "mountPath": c.ENGINE_TMP_PATH},
    ]
    kind, source = model_source(spec)
    if kind in ("pvc", "hostPath", "download"):
        # Read-only unless a pvc source asks otherwise (e.g. an engine that writes a
        # compilation cache next to the weights).
        read_only = bool(source.get("readOnly", True)) if kind == "pvc" else True
        mount = {"name": MODEL_VOLUME, "mountPath": c.MODEL_MOUNT_PATH, "readOnly": read_only}
        if kind == "pvc" and source.get("subPath"):
            mount["subPath"] = source["subPath"]
        if kind == "download":
            mount["subPath"] = cache_folder(spec)
        mounts.append(mount)
    if kind == "download":
        mounts.append({"name": MODEL_VOLUME, "mountPath": c.KERNEL_CACHE_PATH,
                       "subPath": KERNEL_CACHE_FOLDER})  # fmt: skip
    if adapters_mounted(spec):
        mounts.append({"name": cache_volume(spec), "mountPath": ADAPTERS_MOUNT_PATH,
                       "subPath": ADAPTERS_FOLDER, "readOnly": True})  # fmt: skip
    if downloaded_draft(spec):
        # The draft's folder under it is --speculative-config's (``draft_path``).
        mounts.append({"name": cache_volume(spec), "mountPath": DRAFT_MOUNT_PATH,
                       "subPath": DRAFT_FOLDER, "readOnly": True})  # fmt: skip
    return mounts


def cache_volume(spec: dict[str, Any]) -> str:
    """The engine's volume of the model cache claim: the model's where the weights come from
    it too, else one of its own (named as before drafts were downloaded, for adapters)."""
    if model_source(spec)[0] == "download":
        return MODEL_VOLUME
    return ADAPTER_VOLUME if adapters_mounted(spec) else DRAFT_VOLUME


def adapters_mounted(spec: dict[str, Any]) -> bool:
    """Whether the engines mount the cache's ``adapters/``: for downloaded adapters, and
    wherever LoRA is on and the model is downloaded too, so that the first downloaded
    adapter adds no volume (which would restart the engines)."""
    if downloaded_adapters(spec):
        return True
    return lora_enabled(spec) and model_source(spec)[0] == "download"


def desired_service(llmd: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    name = llmd["metadata"]["name"]
    body = {
        "spec": {
            "type": spec["service"]["type"],
            "selector": selector_labels(name),
            "ports": [
                {
                    "name": c.ENGINE_PORT_NAME,
                    "port": c.ENGINE_PORT,
                    "targetPort": c.ENGINE_PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        }
    }
    return finish(llmd, "v1", "Service", body, annotations=spec["service"].get("annotations"))


def disruption_budget(spec: dict[str, Any]) -> dict[str, int] | None:
    """``spec.disruptionBudget`` as given; otherwise maxUnavailable 1 when more than one
    replica may run (drains take one at a time), and none for a single replica: a budget
    that forbids evicting the only replica would block every node drain until someone
    scales up, so that is left to the user to ask for (minAvailable: 1)."""
    budget = spec.get("disruptionBudget") or {}
    for key in ("minAvailable", "maxUnavailable"):
        if budget.get(key) is not None:
            return {key: int(budget[key])}
    return {"maxUnavailable": 1} if effective_max_replicas(spec) > 1 else None


def desired_pod_disruption_budget(llmd: dict[str, Any], budget: dict[str, int]) -> dict[str, Any]:
    name = llmd["metadata"]["name"]
    body = {"spec": {**budget, "selector": {"matchLabels": selector_labels(name)}}}
    return finish(llmd, "policy/v1", "PodDisruptionBudget", body)


def desired_service_monitor(
    llmd: dict[str, Any], monitor: MonitorSettings = DEFAULT_MONITOR
) -> dict[str, Any]:
    name = llmd["metadata"]["name"]
    body = {
        "spec": {
            "selector": {"matchLabels": selector_labels(name)},
            "endpoints": [
                {
                    "port": c.ENGINE_PORT_NAME,
                    "path": c.METRICS_PATH,
                    "interval": monitor.interval,
                    # The tuner selects an LLMDeployment's series by these labels.
                    "relabelings": [
                        {
                            "sourceLabels": [_pod_label_meta(c.LABEL_OWNER)],
                            "targetLabel": "llmdeployment",
                        }
                    ],
                }
            ],
        }
    }
    # The labels a Prometheus selects ServiceMonitors by (the chart's, then this
    # LLMDeployment's own); ours win a clash (the selector's).
    own = ((llmd.get("spec") or {}).get("monitoring") or {}).get("serviceMonitorLabels") or {}
    labels = {**monitor.labels, **own, **common_labels(name)}
    return finish(llmd, "monitoring.coreos.com/v1", "ServiceMonitor", body, labels=labels)


def _pod_label_meta(label: str) -> str:
    """Prometheus's meta label for a pod label: every non-alphanumeric becomes '_'."""
    return "__meta_kubernetes_pod_label_" + "".join(ch if ch.isalnum() else "_" for ch in label)
