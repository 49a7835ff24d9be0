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
from pagoda_operator.reconcile import EmitEvent, owner_of, reconcile
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
    # The API server sends only the operator's own objects, never every Deployment or Pod of
    # the cluster (the handlers' label filters would only drop them after the transfer).
    for group, version, plural in OWNED_WATCHES:
        settings.watching.label_selectors[group, version, plural] = MANAGED_SELECTOR
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


MANAGED_SELECTOR = f"{c.LABEL_MANAGED_BY}={c.OPERATOR_NAME}"
# (group, plural) of the owned objects whose changes bring their LLMDeployment back to its
# spec: a rollout's progress, a loader Job finishing, an object edited or deleted by hand.
# Loader pods are watched for what their Job cannot tell (a missing Secret, a bad image).
OWNED_WATCHES = (
    ("apps", "v1", "deployments"),
    ("batch", "v1", "jobs"),
    ("", "v1", "services"),
    ("", "v1", "persistentvolumeclaims"),
    ("", "v1", "pods"),
)


async def owned_object_changed(
    body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    obj = plain(body)
    llmd = await owner_of(memo.client, obj, owned_directly=obj.get("kind") != "Pod")
    if llmd is None:
        return
    try:
        await reconcile(
            memo.client,
            llmd,
            emit=event_emitter(llmd),
            default_image=memo.default_image,
            service_monitors=memo.service_monitors,
            logger=logger,
        )
    except kopf.TemporaryError as error:
        # Event handlers are not retried: the next event of this object or its owner is.
        logger.info("Reconcile after a change of %s deferred: %s", obj.get("kind"), error)


for _group, _version, _plural in OWNED_WATCHES:
    kopf.on.event(
        group=_group,
        version=_version,
        plural=_plural,
        labels={c.LABEL_MANAGED_BY: c.OPERATOR_NAME},
    )(owned_object_changed)


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
