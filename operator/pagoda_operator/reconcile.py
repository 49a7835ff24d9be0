"""Carries out the plan for one LLMDeployment and writes its status.

The only module besides ``handlers`` that talks to the API; every decision it acts on comes
from the pure modules.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

from pagoda_operator import constants as c
from pagoda_operator.adapter_sync import sync_adapters
from pagoda_operator.adapters import lora_enabled
from pagoda_operator.autoscalers import KEDA_API_VERSION
from pagoda_operator.desired import DEFAULT_MONITOR, MonitorSettings, desired_objects
from pagoda_operator.diagnosis import NO_FINDINGS, Findings
from pagoda_operator.gateway import PICKER_APP_NAME, POOL_API_VERSION, gateway_spec
from pagoda_operator.kube import KubeClient, KubeError, collection_path, object_path
from pagoda_operator.live_settings import admin_enabled
from pagoda_operator.metrics import due as metrics_due
from pagoda_operator.model_cache import (
    LOADER_JOB_LABEL,
    CacheState,
    cache_claim_name,
    cache_state,
    loader_job_name,
)
from pagoda_operator.observe import cache_claim_pending, engine_pod_problem, metrics_finding
from pagoda_operator.plan import (
    Action,
    ObjectKey,
    is_owned_by,
    owned_keys,
    plan_actions,
    stored_hash,
)
from pagoda_operator.spec import validate_spec, with_defaults
from pagoda_operator.status import (
    model_cache_event,
    now_rfc3339,
    phase_event,
    spec_problem_status,
    status_differs,
    workload_status,
)
from pagoda_operator.storage import settle_claim
from pagoda_operator.tuning.live import ensure_admin_secret

# (event type, reason, message) -> posts an Event on the LLMDeployment.
EmitEvent = Callable[[str, str, str], None]

RETRY_DELAY_SECONDS = 15
CUSTOM_METRICS_API = "custom.metrics.k8s.io/v1beta1"
HPA_METRIC = "vllm_num_requests_waiting"  # as the shipped prometheus-adapter rules name it


def llmd_path(llmd: dict[str, Any]) -> str:
    meta = llmd["metadata"]
    return object_path(c.API_VERSION, c.KIND, meta["namespace"], meta["name"])


async def reconcile(
    client: KubeClient,
    llmd: dict[str, Any],
    *,
    emit: EmitEvent,
    default_image: str,
    logger: logging.Logger,
    service_monitors: bool = True,
    monitor: MonitorSettings = DEFAULT_MONITOR,
    picker_image: str = c.DEFAULT_PICKER_IMAGE,
) -> dict[str, Any]:
    """Brings the owned objects to the spec and records the outcome in the status.

    Spec problems end in a Degraded status and return normally, so kopf does not retry
    until the spec changes. Transient API failures raise kopf.TemporaryError instead.

    It works from a fresh read: the Deployment is rendered from the spec and the tuner's
    overrides in the status, and a body from an older event may lack the latest override
    (rendering from it would roll the engines back and forth).
    """
    try:
        fresh = await client.get(llmd_path(llmd))
    except (KubeError, aiohttp.ClientError) as error:
        message = f"reading the LLMDeployment: {error}"
        raise kopf.TemporaryError(message, delay=RETRY_DELAY_SECONDS) from error
    if fresh is None:
        return {}  # deleted meanwhile: its owned objects go with it
    llmd = fresh
    errors = validate_spec(with_defaults(llmd.get("spec") or {}))
    if errors:
        message = "; ".join(errors)
        logger.warning("Invalid spec: %s", message)
        return await write_status(
            client, llmd, spec_problem_status(llmd, "InvalidSpec", message, now_rfc3339()), emit
        )
    try:
        applied = await apply_owned_objects(
            client,
            llmd,
            emit,
            default_image,
            service_monitors=service_monitors,
            monitor=monitor,
            picker_image=picker_image,
        )
    except KubeError as error:
        if error.retryable:
            raise kopf.TemporaryError(str(error), delay=RETRY_DELAY_SECONDS) from error
        logger.warning("API rejected an owned object: %s", error)
        status = spec_problem_status(llmd, "ApplyFailed", str(error), now_rfc3339())
        return await write_status(client, llmd, status, emit)
    except aiohttp.ClientError as error:
        raise kopf.TemporaryError(f"API unreachable: {error}", delay=RETRY_DELAY_SECONDS) from error
    except NameConflictError as error:
        status = spec_problem_status(llmd, "NameConflict", str(error), now_rfc3339())
        return await write_status(client, llmd, status, emit)
    previous_generation = (llmd.get("status") or {}).get("observedGeneration")
    adapters = None
    spec = with_defaults(llmd.get("spec") or {})
    if lora_enabled(spec):
        delivered = applied.cache is None or applied.cache.ready
        adapters = await sync_adapters(client, llmd, spec, delivered=delivered)
        for event in adapters.events:
            emit(*event)
    now = now_rfc3339()
    status = workload_status(
        llmd,
        applied.deployment,
        now,
        keep_spec_problem=False,
        cache=applied.cache,
        applied_generation=previous_generation if applied.deployment_held else None,
        findings=await observed_findings(client, llmd, applied, now, logger),
        adapters=adapters,
    )
    return await write_status(client, llmd, status, emit)


async def observed_findings(
    client: KubeClient, llmd: dict[str, Any], applied: Applied, now: str, logger: logging.Logger
) -> Findings:
    """``applied.findings`` with what the engine pods and the cache claim say. Reading them
    may fail (an older ClusterRole without ``events: list``): the status then lacks only the
    diagnosis, never the rest."""
    meta = llmd["metadata"]
    findings = applied.findings
    try:
        if applied.deployment is not None:
            pods = await engine_pod_problem(client, meta["namespace"], meta["name"], now)
            findings = dataclasses.replace(findings, pods=pods)
        if applied.cache is not None and not applied.cache.ready:
            pending = await cache_claim_pending(client, applied.claim, now)
            findings = dataclasses.replace(findings, claim_pending=pending)
        if metrics_due(llmd, now):
            scraped = await metrics_finding(
                client,
                llmd,
                monitor_labels=applied.monitor_labels,
                operator_monitors=applied.operator_monitors,
            )
            findings = dataclasses.replace(findings, metrics=scraped)
    except (KubeError, aiohttp.ClientError) as error:
        logger.warning("Reading the pods or Events for the status failed: %s", error)
    return findings


@dataclass(frozen=True)
class Applied:
    deployment: dict[str, Any] | None
    cache: CacheState | None  # None when the weights are not downloaded
    deployment_held: bool  # the Deployment still runs an earlier generation's spec
    findings: Findings = NO_FINDINGS
    claim: dict[str, Any] | None = None  # the cache claim as read
    monitor_labels: dict[str, str] | None = None  # the ServiceMonitor's; None: none served
    operator_monitors: bool = True  # the operator makes ServiceMonitors (not the chart)


class NameConflictError(Exception):
    """An object with the LLMDeployment's name exists and belongs to someone else."""


async def apply_owned_objects(
    client: KubeClient,
    llmd: dict[str, Any],
    emit: EmitEvent,
    default_image: str,
    *,
    service_monitors: bool,
    monitor: MonitorSettings = DEFAULT_MONITOR,
    picker_image: str = c.DEFAULT_PICKER_IMAGE,
) -> Applied:
    """Creates, updates and deletes owned objects; returns the Deployment as it is now, the
    model cache's state, and whether the Deployment's update waits for the cache."""
    namespace, name = llmd["metadata"]["namespace"], llmd["metadata"]["name"]
    spec = with_defaults(llmd.get("spec") or {})
    served = ServedApis(
        service_monitors=service_monitors
        and await client.serves("monitoring.coreos.com/v1", "servicemonitors"),
        keda=await client.serves(KEDA_API_VERSION, "scaledobjects"),
        # Asked even when unwanted: a pool left from an earlier spec is deleted.
        inference_pools=await client.serves(POOL_API_VERSION, "inferencepools"),
    )
    existing = await read_existing(client, llmd, served)
    live_claim = existing[("v1", "PersistentVolumeClaim", cache_claim_name(name))]

    def render(model_cached: bool) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
        rendered = desired_objects(
            llmd,
            service_monitor_api=served.service_monitors,
            default_image=default_image,
            model_cached=model_cached,
            monitor=monitor,
            picker_image=picker_image,
        )
        return settled_objects(rendered, live_claim, spec, served)

    desired, claim_problems = render(model_cached=True)
    loader = existing.get(("batch/v1", "Job", loader_job_name(name)))
    cache = await model_cache_state(client, desired, loader)
    if cache is not None and not cache.ready:
        desired, claim_problems = render(model_cached=False)
    actions = plan_actions(desired, existing, llmd["metadata"]["uid"])
    held = False
    if cache is not None and not cache.ready:
        # Whatever serves now keeps serving until the new weights are in the cache.
        engine_update = ("update", "apps/v1", "Deployment", name)
        held = any((a.verb, a.api_version, a.kind, a.name) == engine_update for a in actions)
        actions = [a for a in actions if (a.verb, a.api_version, a.kind, a.name) != engine_update]
    conflicts = [action for action in actions if action.verb == "conflict"]
    if conflicts:
        messages = "; ".join(action.event_message for action in conflicts)
        emit("Warning", "NameConflict", messages)
        raise NameConflictError(messages)
    if admin_enabled(spec):  # the engines' admin key, which their pods mount
        await ensure_admin_secret(client, llmd)
    deployment, refused = await carry_out_actions(
        client, actions, name, namespace, emit, existing[("apps/v1", "Deployment", name)]
    )
    findings = Findings(
        claim_problems=claim_problems + refused if cache is not None else None,
        autoscaling=await autoscaling_problem(client, spec, served.keda),
        gateway=gateway_problem(spec, served.inference_pools),
    )
    monitor_labels = next(
        (obj["metadata"]["labels"] for obj in desired if obj["kind"] == "ServiceMonitor"),
        {} if served.service_monitors else None,
    )
    return Applied(deployment, cache, held, findings, live_claim, monitor_labels, service_monitors)


@dataclass(frozen=True)
class ServedApis:
    """Which optional APIs the cluster serves (and the operator uses) right now."""

    service_monitors: bool
    keda: bool
    inference_pools: bool = False

    def serves(self, api_version: str, kind: str) -> bool:
        if kind == "ServiceMonitor":
            return self.service_monitors
        if api_version == KEDA_API_VERSION:
            return self.keda
        if api_version == POOL_API_VERSION:
            return self.inference_pools
        return True


async def read_existing(
    client: KubeClient, llmd: dict[str, Any], served: ServedApis
) -> dict[tuple[str, str], dict[str, Any] | None]:
    """Each object the LLMDeployment may own, None where there is none (or the cluster
    does not serve its kind)."""
    namespace, name = llmd["metadata"]["namespace"], llmd["metadata"]["name"]
    existing: dict[ObjectKey, dict[str, Any] | None] = {}
    for key in owned_keys(name):
        api_version, kind, object_name = key
        if not served.serves(api_version, kind):
            existing[key] = None
            continue
        existing[key] = await client.get(object_path(api_version, kind, namespace, object_name))
    return existing


def settled_objects(
    desired: list[dict[str, Any]],
    live_claim: dict[str, Any] | None,
    spec: dict[str, Any],
    served: ServedApis,
) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """``desired`` as the cluster can take it: no KEDA objects without KEDA, and no
    InferencePool nor endpoint picker without the InferencePool API (an absent optional
    integration is a condition, never a reason to hold the engines), and the cache claim
    with the live claim's immutable fields; plus what the claim cannot follow."""
    result, problems = [], []
    for obj in desired:
        if obj["apiVersion"] == KEDA_API_VERSION and not served.keda:
            continue
        if is_gateway_object(obj) and not served.inference_pools:
            continue
        if obj["kind"] == "PersistentVolumeClaim":
            settled = settle_claim(obj, live_claim, spec)
            obj, problems = settled.claim, settled.problems
        result.append(obj)
    return result, problems


async def carry_out_actions(
    client: KubeClient,
    actions: list[Action],
    name: str,
    namespace: str,
    emit: EmitEvent,
    deployment: dict[str, Any] | None,
) -> tuple[dict[str, Any] | None, list[tuple[str, str]]]:
    """Carries out each action; returns the Deployment as it is now, and the claim's
    refusals: a claim the API server refuses (a resize its class cannot do) must not stop
    the Deployment, applied after it, from following the spec."""
    refused = []
    for action in actions:
        try:
            result = await _carry_out(client, action, namespace)
        except KubeError as error:
            if action.kind != "PersistentVolumeClaim" or error.retryable:
                raise
            refused.append(("ApplyFailed", f"the API server refused it: {error.message}"))
            continue
        emit("Normal", action.event_reason, action.event_message)
        if (action.kind, action.name) == ("Deployment", name):  # the engines', not the picker's
            deployment = result
    return deployment, refused


async def autoscaling_problem(
    client: KubeClient, spec: dict[str, Any], keda_api: bool
) -> tuple[str, str] | None:
    """Why the autoscaler the spec asks for cannot scale in this cluster, if it cannot."""
    autoscaling = spec["autoscaling"]
    if not autoscaling["enabled"]:
        return None
    if autoscaling["backend"] == "KEDA":
        if keda_api:
            return None
        return "MissingAPI", (
            f"spec.autoscaling.backend is KEDA, but the cluster serves no {KEDA_API_VERSION} "
            "ScaledObjects: install KEDA (the ScaledObject is created once it is there), or "
            "use the HPA backend; meanwhile the replicas stay at spec.replicas"
        )
    served = await client.resources(CUSTOM_METRICS_API)
    if served is None:
        return "MissingAPI", (
            f"the HPA backend reads {CUSTOM_METRICS_API}, which the cluster does not serve: "
            "install prometheus-adapter with manifests/autoscaling/prometheus-adapter-values.yaml"
            ", or use the KEDA backend"
        )
    if f"pods/{HPA_METRIC}" not in served:
        return "MetricMissing", (
            f"{CUSTOM_METRICS_API} does not serve pods/{HPA_METRIC}: add the rules of "
            "manifests/autoscaling/prometheus-adapter-values.yaml to the prometheus-adapter"
        )
    return None


def is_gateway_object(obj: dict[str, Any]) -> bool:
    """The InferencePool and everything of its endpoint picker (labelled as the picker)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return obj["kind"] == "InferencePool" or labels.get(c.LABEL_NAME) == PICKER_APP_NAME


def gateway_problem(spec: dict[str, Any], pools_served: bool) -> tuple[str, str] | None:
    """Why spec.routing.gateway cannot take effect in this cluster, if it cannot."""
    if gateway_spec(spec) is None or pools_served:
        return None
    return "MissingAPI", (
        f"spec.routing.gateway is set, but the cluster serves no {POOL_API_VERSION} "
        "InferencePools: install the Gateway API inference extension's CRDs (the "
        "InferencePool and its endpoint picker are created once they are there); "
        "meanwhile the engines serve through their Service as usual"
    )


async def model_cache_state(
    client: KubeClient, desired: list[dict[str, Any]], job: dict[str, Any] | None
) -> CacheState | None:
    """The cache's state from the loader Job and its pods; None without a download source."""
    wanted = next((obj for obj in desired if obj["kind"] == "Job"), None)
    if wanted is None:
        return None
    pods: list[dict[str, Any]] = []
    if job is not None:
        meta = job["metadata"]
        pods = await client.list(
            collection_path("v1", "Pod", meta["namespace"]), {LOADER_JOB_LABEL: meta["name"]}
        )
    return cache_state(job, pods, stored_hash(wanted))


async def _carry_out(client: KubeClient, action: Action, namespace: str) -> dict[str, Any] | None:
    path = object_path(action.api_version, action.kind, namespace, action.name)
    if action.verb == "delete":
        await client.delete(path)
        return None
    assert action.obj is not None  # create, update and replace carry the desired object
    if action.verb == "replace":
        await client.delete(path)  # a conflict on the create below retries the whole pass
    return await client.apply(action.obj)


async def write_status(
    client: KubeClient, llmd: dict[str, Any], status: dict[str, Any], emit: EmitEvent
) -> dict[str, Any]:
    """Patches the status when it changed and announces a phase change as an Event."""
    previous = llmd.get("status") or {}
    if status_differs(previous, status):
        await client.patch_status(llmd_path(llmd), status)
        for event in (
            model_cache_event(previous, status),
            phase_event(previous.get("phase"), status),
        ):
            if event is not None:
                emit(*event)
    return status


async def owner_of(
    client: KubeClient, obj: dict[str, Any], *, owned_directly: bool = True
) -> dict[str, Any] | None:
    """The live LLMDeployment named by the object's owner label, if there is one; with
    ``owned_directly``, only when the object's controller reference points at it (a loader
    pod belongs to the Job, not to the LLMDeployment)."""
    meta = obj.get("metadata") or {}
    owner_name = (meta.get("labels") or {}).get(c.LABEL_OWNER)
    if not owner_name:
        return None
    llmd = await client.get(object_path(c.API_VERSION, c.KIND, meta["namespace"], owner_name))
    if llmd is None or (llmd.get("metadata") or {}).get("deletionTimestamp"):
        return None
    if owned_directly and not is_owned_by(obj, (llmd.get("metadata") or {}).get("uid", "")):
        return None
    return llmd
