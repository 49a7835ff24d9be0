"""kopf handlers: each one hands its object to ``reconcile`` and returns.

Run with ``kopf run --standalone --all-namespaces -m pagoda_operator.handlers`` or
``python -m pagoda_operator``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import weakref
from collections.abc import Mapping
from typing import Any

import kopf

from pagoda_operator import constants as c
from pagoda_operator.desired import MonitorSettings
from pagoda_operator.kube import KubeClient
from pagoda_operator.peering import RunOptions, led_llmdeployments
from pagoda_operator.reconcile import EmitEvent, owner_of, reconcile
from pagoda_operator.status import needs_recheck
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
    # kopf turns its per-object log lines into Events at this level: "Handler succeeded" on
    # every rollout step of every owned object would be an API write each, so only problems
    # become Events. The operator's own Events (Created, Updated, Phase..., ModelCached) are
    # posted explicitly.
    settings.posting.level = logging.WARNING
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
    memo.picker_image = os.environ.get(c.PICKER_IMAGE_ENV) or c.DEFAULT_PICKER_IMAGE
    memo.service_monitors = os.environ.get(c.SERVICE_MONITORS_ENV, "true").lower() != "false"
    memo.monitor = MonitorSettings(
        labels=json.loads(os.environ.get(c.SERVICE_MONITOR_LABELS_ENV) or "{}"),
        interval=os.environ.get(c.SERVICE_MONITOR_INTERVAL_ENV) or c.DEFAULT_SCRAPE_INTERVAL,
    )
    # The tuner is not a kopf timer: kopf puts a finalizer on every object a timer runs for,
    # and with the CRD kept on uninstall, deleting a tuned LLMDeployment would then hang for
    # good once the operator is gone. A loop of our own needs no finalizer.
    memo.object_locks = weakref.WeakValueDictionary()
    memo.tuner_running = {}
    memo.tuner_events = set()
    memo.tuner = asyncio.create_task(tuner_loop(memo))
    memo.recheck = asyncio.create_task(recheck_loop(memo))


@kopf.on.cleanup()
async def close_client(memo: kopf.Memo, **_: Any) -> None:
    tasks = [memo.tuner, memo.recheck, *memo.tuner_running.values(), *memo.tuner_events]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await memo.client.close()


@kopf.on.create(c.GROUP, c.VERSION, c.PLURAL)
@kopf.on.resume(c.GROUP, c.VERSION, c.PLURAL)
@kopf.on.update(c.GROUP, c.VERSION, c.PLURAL, field="spec")
async def reconcile_llmdeployment(
    body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    await reconcile_locked(memo, plain(body), event_emitter(body), logger)


async def reconcile_locked(
    memo: kopf.Memo, llmd: dict[str, Any], emit: EmitEvent, logger: Any
) -> None:
    """``reconcile`` with the operator's settings, under the object's lock (every caller
    of ``reconcile`` comes through here)."""
    async with object_lock(memo, llmd):
        await reconcile(
            memo.client,
            llmd,
            emit=emit,
            default_image=memo.default_image,
            picker_image=memo.picker_image,
            service_monitors=memo.service_monitors,
            monitor=memo.monitor,
            logger=logger,
        )


def object_lock(memo: kopf.Memo, llmd: Mapping[str, Any]) -> asyncio.Lock:
    """The one lock of an LLMDeployment: its reconciles (kopf's handlers, owned objects'
    events, the recheck and the tuner's) and the tuner's status writes take turns.

    A reconcile renders the Deployment from a fresh read of the spec and the tuner's
    overrides; one that read before the tuner recorded an override and applied after it
    would roll the engines back to the old value, and the next reconcile forward again (a
    restart each). Held, the lock keeps a reconcile's read and its apply on one side of
    every tuner write. Locks are dropped with the last task that holds one."""
    locks = getattr(memo, "object_locks", None)
    if locks is None:
        locks = memo.object_locks = weakref.WeakValueDictionary()
    meta = llmd.get("metadata") or {}
    key = meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}"
    lock = locks.get(key)
    if lock is None:
        lock = locks[key] = asyncio.Lock()
    return lock


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
        await reconcile_locked(memo, llmd, event_emitter(llmd), logger)
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


TUNER_LOGGER = logging.getLogger("pagoda_operator.tuner")
RECHECK_LOGGER = logging.getLogger("pagoda_operator.recheck")
RECHECK_INTERVAL_ENV = "PAGODA_RECHECK_INTERVAL_SECONDS"
DEFAULT_RECHECK_INTERVAL_SECONDS = 60.0


async def recheck_loop(memo: kopf.Memo) -> None:
    """Every interval, a reconcile of each LLMDeployment that is not settled (see
    ``status.needs_recheck``): what keeps it from settling may change nothing it watches.
    A loop of our own, not a kopf timer, for the reason ``configure`` gives."""
    interval = float(os.environ.get(RECHECK_INTERVAL_ENV) or DEFAULT_RECHECK_INTERVAL_SECONDS)
    while True:
        await asyncio.sleep(interval)
        try:
            listed = await memo.client.get(f"/apis/{c.API_VERSION}/{c.PLURAL}")
        except Exception:
            RECHECK_LOGGER.exception("Listing LLMDeployments failed; trying again next round")
            continue
        for llmd in (listed or {}).get("items") or []:
            if (llmd.get("metadata") or {}).get("deletionTimestamp") or not needs_recheck(llmd):
                continue
            llmd.setdefault("apiVersion", c.API_VERSION)
            llmd.setdefault("kind", c.KIND)
            meta = llmd["metadata"]
            logger = ObjectLogger(RECHECK_LOGGER, {"object": f"{meta['namespace']}/{meta['name']}"})
            try:
                emit = api_event_emitter(memo.client, llmd, memo.tuner_events)
                await reconcile_locked(memo, llmd, emit, logger)
            except Exception as error:  # one object's trouble never ends the loop
                logger.warning("Periodic reconcile failed; next round retries: %s", error)


class ObjectLogger(logging.LoggerAdapter):
    """Prefixes messages with the object, as kopf's per-object loggers do."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[{(self.extra or {}).get('object')}] {msg}", kwargs


async def tuner_loop(memo: kopf.Memo) -> None:
    """Every interval, one tuner window for each LLMDeployment with tuning on (a window still
    running from the last round is left to finish, not started twice)."""
    interval = tuning.interval_seconds()
    while True:
        await asyncio.sleep(interval)
        try:
            # Only the watched namespaces, and only on the replica that leads the peering.
            options = getattr(memo, "run_options", None) or RunOptions()
            items = await led_llmdeployments(memo.client, options)
        except Exception:
            TUNER_LOGGER.exception("Listing LLMDeployments failed; trying again next round")
            continue
        listed_uids = {(item.get("metadata") or {}).get("uid") for item in items}
        for key in [k for k, task in memo.tuner_running.items() if task.done()]:
            if key not in listed_uids:
                del memo.tuner_running[key]  # that object is gone
        for llmd in items:
            meta = llmd.get("metadata") or {}
            key = meta.get("uid")
            if meta.get("deletionTimestamp") or not tuning.tuning_enabled(llmd.get("spec")):
                continue
            running = memo.tuner_running.get(key)
            if running is not None and not running.done():
                continue
            llmd.setdefault("apiVersion", c.API_VERSION)
            llmd.setdefault("kind", c.KIND)
            memo.tuner_running[key] = asyncio.create_task(tune_llmdeployment(llmd, memo))


def api_event_emitter(client: KubeClient, llmd: dict[str, Any], pending: set) -> EmitEvent:
    """Posts Events through the operator's own client: the tuner loop runs outside kopf's
    handlers, where kopf.event has nothing to post through."""

    def emit(event_type: str, reason: str, message: str) -> None:
        task = asyncio.get_running_loop().create_task(
            client.post_event(llmd, event_type, reason, message)
        )
        pending.add(task)  # held until done, so the task is not collected half-way
        task.add_done_callback(_event_posted(pending))

    return emit


def _event_posted(pending: set) -> Any:
    def done(task: asyncio.Task) -> None:
        pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            TUNER_LOGGER.warning("Posting a tuner Event failed: %s", task.exception())

    return done


async def tune_llmdeployment(llmd: dict[str, Any], memo: kopf.Memo) -> None:
    meta = llmd["metadata"]
    logger = ObjectLogger(TUNER_LOGGER, {"object": f"{meta.get('namespace')}/{meta.get('name')}"})
    emit = api_event_emitter(memo.client, llmd, memo.tuner_events)
    lock = object_lock(memo, llmd)

    async def apply_owned(current: dict[str, Any]) -> None:
        await reconcile_locked(memo, current, emit, logger)

    # Errors end the window, never the loop: the next window simply tries again.
    try:
        await tuning.tune(
            memo.client,
            llmd,
            emit=emit,
            logger=logger,
            window_s=tuning.window_seconds(),
            apply_owned=apply_owned,
            lock=lock,
        )
    except Exception:
        TUNER_LOGGER.exception(
            "[%s/%s] Tuner window failed; holding until the next one",
            meta.get("namespace"),
            meta.get("name"),
        )


def plain(body: Mapping[str, Any]) -> dict[str, Any]:
    """A plain, deep dict copy of a kopf body, safe to hand to the pure functions."""
    return json.loads(json.dumps(body, default=dict))


@kopf.on.probe(id="engine_image")
def engine_image_probe(memo: kopf.Memo, **_: Any) -> str:
    return str(memo.default_image)
