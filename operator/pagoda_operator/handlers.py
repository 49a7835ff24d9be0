"""kopf handlers: each one hands its object to ``reconcile`` and returns.

Run with ``kopf run --standalone --all-namespaces -m pagoda_operator.handlers`` or
``python -m pagoda_operator``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import kopf

from pagoda_operator import constants as c
from pagoda_operator.kube import KubeClient
from pagoda_operator.reconcile import (
    EmitEvent,
    owner_of,
    reconcile,
    refresh_status_from_deployment,
)
from pagoda_operator.tuning import runner as tuning


def connection_info(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """In a pod, its service account; elsewhere, the current kubeconfig context."""
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(
        settings=settings
    )
    if info is None:
        raise kopf.LoginError("No service account token and no kubeconfig found.")
    return info


def event_emitter(body: Mapping[str, Any]) -> EmitEvent:
    def emit(event_type: str, reason: str, message: str) -> None:
        kopf.event(body, type=event_type, reason=reason, message=message[:1000])

    return emit


@kopf.on.login()
def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    return connection_info(settings)


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Keep kopf's bookkeeping in our own annotations and out of .status, which is ours.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=c.GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{c.GROUP}/finalizer"
    settings.posting.level = logging.INFO
    # Watches restart every few minutes so a silently dropped connection cannot go unnoticed.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # Only our own, fixed resources are watched: no need to read (or be allowed to read) CRDs.
    settings.scanning.disabled = True
    memo.client = KubeClient(lambda: connection_info(settings))
    memo.default_image = os.environ.get(c.ENGINE_IMAGE_ENV, c.DEFAULT_ENGINE_IMAGE)
    memo.service_monitors = os.environ.get(c.SERVICE_MONITORS_ENV, "true").lower() != "false"


@kopf.on.cleanup()
async def close_client(memo: kopf.Memo, **_: Any) -> None:
    await memo.client.close()


@kopf.on.create(c.GROUP, c.VERSION, c.PLURAL)
@kopf.on.resume(c.GROUP, c.VERSION, c.PLURAL)
@kopf.on.update(c.GROUP, c.VERSION, c.PLURAL, field="spec")
async def reconcile_llmdeployment(
    body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    await reconcile(
        memo.client,
        plain(body),
        emit=event_emitter(body),
        default_image=memo.default_image,
        service_monitors=memo.service_monitors,
        logger=logger,
    )


@kopf.on.delete(c.GROUP, c.VERSION, c.PLURAL, optional=True)
def announce_deletion(body: kopf.Body, **_: Any) -> None:
    # No finalizer of ours: the garbage collector removes the owned objects through their
    # owner references, so deletion never waits for the operator. This runs only while
    # another finalizer (foreground deletion, for one) holds the object.
    kopf.info(body, reason="Deleting", message="Owned objects go with their owner reference")


@kopf.on.event("apps", "v1", "deployments", labels={c.LABEL_MANAGED_BY: c.OPERATOR_NAME})
async def deployment_changed(
    body: kopf.Body, type: str | None, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    deployment = plain(body)
    if type != "DELETED":
        await refresh_status_from_deployment(memo.client, deployment, event_emitter)
        return
    # Deleted by hand while its LLMDeployment lives on: put it back.
    llmd = await owner_of(memo.client, deployment)
    if llmd is not None:
        await reconcile(
            memo.client,
            llmd,
            emit=event_emitter(llmd),
            default_image=memo.default_image,
            service_monitors=memo.service_monitors,
            logger=logger,
        )


@kopf.timer(
    c.GROUP,
    c.VERSION,
    c.PLURAL,
    id="tuner",
    interval=tuning.interval_seconds(),
    initial_delay=tuning.interval_seconds(),
    when=tuning.tuning_enabled,
)
async def tune_llmdeployment(
    body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    # Errors must not reach kopf: it would keep them in the object and retry at its own
    # pace. The next window simply tries again.
    try:
        await tuning.tune(
            memo.client,
            plain(body),
            emit=event_emitter(body),
            logger=logger,
            window_s=tuning.window_seconds(),
        )
    except Exception:
        logger.exception("Tuner window failed; holding until the next one")


def plain(body: Mapping[str, Any]) -> dict[str, Any]:
    """A plain, deep dict copy of a kopf body, safe to hand to the pure functions."""
    return json.loads(json.dumps(body, default=dict))


@kopf.on.probe(id="engine_image")
def engine_image_probe(memo: kopf.Memo, **_: Any) -> str:
    return str(memo.default_image)
