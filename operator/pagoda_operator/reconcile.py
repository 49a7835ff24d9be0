"""Carries out the plan for one LLMDeployment and writes its status.

The only module besides ``handlers`` that talks to the API; every decision it acts on comes
from the pure modules.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

from pagoda_operator import constants as c
from pagoda_operator.desired import (
    DEFAULT_MONITOR,
    KEDA_API_VERSION,
    MonitorSettings,
    desired_objects,
)
from pagoda_operator.kube import KubeClient, KubeError, collection_path, object_path
from pagoda_operator.model_cache import LOADER_JOB_LABEL, CacheState, cache_state
from pagoda_operator.plan import (
    OWNED_KINDS,
    Action,
    is_owned_by,
    owned_name,
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

# (event type, reason, message) -> posts an Event on the LLMDeployment.
EmitEvent = Callable[[str, str, str], None]

RETRY_DELAY_SECONDS = 15


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
            client, llmd, emit, default_image, service_monitors=service_monitors, monitor=monitor
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
    except MissingApiError as error:
        logger.warning("%s", error)
        status = spec_problem_status(llmd, "MissingAPI", str(error), now_rfc3339())
        return await write_status(client, llmd, status, emit)
    previous_generation = (llmd.get("status") or {}).get("observedGeneration")
    status = workload_status(
        llmd,
        applied.deployment,
        now_rfc3339(),
        keep_spec_problem=False,
        cache=applied.cache,
        applied_generation=previous_generation if applied.deployment_held else None,
    )
    return await write_status(client, llmd, status, emit)


@dataclass(frozen=True)
class Applied:
    deployment: dict[str, Any] | None
    cache: CacheState | None  # None when the weights are not downloaded
    deployment_held: bool  # the Deployment still runs an earlier generation's spec


class NameConflictError(Exception):
    """An object with the LLMDeployment's name exists and belongs to someone else."""


class MissingApiError(Exception):
    """The spec asks for an object of a kind the cluster does not serve (KEDA's)."""


async def apply_owned_objects(
    client: KubeClient,
    llmd: dict[str, Any],
    emit: EmitEvent,
    default_image: str,
    *,
    service_monitors: bool,
    monitor: MonitorSettings = DEFAULT_MONITOR,
) -> Applied:
    """Creates, updates and deletes owned objects; returns the Deployment as it is now, the
    model cache's state, and whether the Deployment's update waits for the cache."""
    namespace, name = llmd["metadata"]["namespace"], llmd["metadata"]["name"]
    service_monitor_api = service_monitors and await client.serves(
        "monitoring.coreos.com/v1", "servicemonitors"
    )
    keda_api = await client.serves(KEDA_API_VERSION, "scaledobjects")
    desired = desired_objects(
        llmd, service_monitor_api=service_monitor_api, default_image=default_image, monitor=monitor
    )
    if not keda_api and any(obj["apiVersion"] == KEDA_API_VERSION for obj in desired):
        raise MissingApiError(
            "spec.autoscaling.backend is KEDA, but the cluster serves no "
            f"{KEDA_API_VERSION} ScaledObjects: install KEDA, or use the HPA backend"
        )
    existing = {}
    for api_version, kind in OWNED_KINDS:
        served = keda_api if api_version == KEDA_API_VERSION else True
        if (kind == "ServiceMonitor" and not service_monitor_api) or not served:
            existing[(api_version, kind)] = None
            continue
        existing[(api_version, kind)] = await client.get(
            object_path(api_version, kind, namespace, owned_name(kind, name))
        )
    cache = await model_cache_state(client, desired, existing.get(("batch/v1", "Job")))
    if cache is not None and not cache.ready:
        desired = desired_objects(
            llmd,
            service_monitor_api=service_monitor_api,
            default_image=default_image,
            model_cached=False,
            monitor=monitor,
        )
    actions = plan_actions(desired, existing, llmd["metadata"]["uid"])
    held = False
    if cache is not None and not cache.ready:
        # Whatever serves now keeps serving until the new weights are in the cache.
        held = any(a.kind == "Deployment" and a.verb == "update" for a in actions)
        actions = [a for a in actions if not (a.kind == "Deployment" and a.verb == "update")]
    conflicts = [action for action in actions if action.verb == "conflict"]
    if conflicts:
        messages = "; ".join(action.event_message for action in conflicts)
        emit("Warning", "NameConflict", messages)
        raise NameConflictError(messages)
    deployment = existing[("apps/v1", "Deployment")]
    for action in actions:
        result = await _carry_out(client, action, namespace)
        emit("Normal", action.event_reason, action.event_message)
        if action.kind == "Deployment":
            deployment = result
    return Applied(deployment, cache, held)


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
