"""One tuner window for one LLMDeployment: observe, decide, record, apply (Auto).

The only tuning module that does I/O; every decision comes from ``policy`` and every status
field from ``record``. A change is an override in ``status.tuning.overrides`` (the spec stays
the user's); the reconciler renders the Deployment from both.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import dataclasses
import datetime
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pagoda_operator.kube import KubeClient, KubeError
from pagoda_operator.live_settings import ENGINE_SETTINGS, live_enabled
from pagoda_operator.overrides import effective_spec, recorded_overrides
from pagoda_operator.reconcile import EmitEvent, llmd_path
from pagoda_operator.spec import validate_spec, with_defaults
from pagoda_operator.status import set_condition
from pagoda_operator.tuning.knobs import (
    current_settings,
    limits_from_spec,
    overrides_in_force,
    overrides_patch,
    rollout_complete,
    with_change,
)
from pagoda_operator.tuning.live import LiveOutcome, PostChange, apply_live, post_change
from pagoda_operator.tuning.policy import Decision, decide, fmt
from pagoda_operator.tuning.prometheus import Observation, PrometheusEndpoint, observe
from pagoda_operator.tuning.record import (
    Event,
    condition_events,
    metrics_condition,
    tuning_status,
)
from pagoda_operator.tuning.state import TunerState

INTERVAL_ENV = "PAGODA_TUNING_INTERVAL_SECONDS"
WINDOW_ENV = "PAGODA_TUNING_WINDOW_SECONDS"
DEFAULT_INTERVAL_SECONDS = 60.0

# Tries at writing one window's status before giving the window up.
WRITE_ATTEMPTS = 5

Observe = Callable[[PrometheusEndpoint, str, str, float], Awaitable[Observation]]
# Applies the owned objects of an LLMDeployment as read (the reconciler).
ApplyOwned = Callable[[dict[str, Any]], Awaitable[Any]]


def interval_seconds() -> float:
    """How often the tuner looks at each LLMDeployment (operator-wide)."""
    return float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_SECONDS))


def window_seconds() -> float:
    """The metrics window of one look; by default the interval, so windows do not overlap."""
    return float(os.environ.get(WINDOW_ENV) or interval_seconds())


def tuning_enabled(spec: Any, **_: Any) -> bool:
    """kopf ``when=`` filter: the timer runs only for LLMDeployments that ask for tuning."""
    return ((spec or {}).get("tuning") or {}).get("mode", "Off") != "Off"


async def tune(
    client: KubeClient,
    llmd: dict[str, Any],
    *,
    emit: EmitEvent,
    logger: logging.Logger,
    window_s: float,
    apply_owned: ApplyOwned,
    observe_fn: Observe = observe,
    clock: Callable[[], float] = time.time,
    post_change: PostChange = post_change,
    lock: asyncio.Lock | None = None,
) -> dict[str, Any] | None:
    """Runs one window; returns the ``status.tuning`` it wrote (None when tuning is off).

    An engine-knob change is first made in the running engines (``tuning.live``), pod by
    pod; only one they cannot take live rolls out by restart. The tuner's state and
    overrides live in the status, and the window starts from a fresh read of it: the body
    kopf hands the timer may predate this tuner's own last write. The write is conditional
    on the resourceVersion read; on a conflict the window is decided again (on the same
    metrics) from a new read, so no write ever rests on a stale state. ``lock`` is the
    object's reconcile lock (``handlers.object_lock``): the write waits for a reconcile in
    flight, which would otherwise apply a Deployment rendered from before it.
    """
    path = llmd_path(llmd)
    fresh = await client.get(path)
    if fresh is None or _tuning_off(fresh):
        return None  # gone, off, or an invalid spec (reconcile's to report)
    if (fresh.get("status") or {}).get("phase") == "ScaledToZero":
        # No engine runs (autoscaling.minReplicas 0): no window to measure or judge, and a
        # knob moved now would be judged on the cold start that follows.
        return (fresh.get("status") or {}).get("tuning")
    meta, spec = fresh["metadata"], with_defaults(fresh.get("spec") or {})
    try:
        endpoint = await prometheus_endpoint(client, meta["namespace"], spec["prometheus"])
        observation = await observe_fn(endpoint, meta["namespace"], meta["name"], window_s)
    except CredentialsError as error:
        observation = Observation(None, str(error), "CredentialsMissing")
    now = clock()
    tried: dict[tuple[str, float], LiveOutcome] = {}  # a re-decided window asks engines once

    async def decided(state: dict[str, Any]) -> Window:
        """The window decided on ``state``, with its live change made in the engines."""
        window = decide_window(state, observation, now)
        change = live_change(state, window.decision)
        if change is not None:
            if change not in tried:
                tried[change] = await apply_live(client, state, *change, post_change)
            window = with_live_outcome(window, tried[change])
        return window

    # Decided (and a live change made, which may take a graph capture's time) outside the
    # lock; under it, the state read again and, where a reconcile wrote meanwhile, the
    # window decided again on what it wrote, so waiting for the lock never makes the write
    # conflict.
    window = await decided(fresh)
    for attempt in range(1, WRITE_ATTEMPTS + 1):
        async with lock or contextlib.nullcontext():
            if lock is not None:
                current = await client.get(path)
                if current is None or _tuning_off(current):
                    return None
                if _version(current) != _version(fresh):
                    fresh = current
                    window = await decided(fresh)
            _log_decision(logger, window.decision)
            try:
                written = await client.patch_status(
                    path, window.status, resource_version=_version(fresh)
                )
                break
            except KubeError as error:
                if error.status != 409 or attempt == WRITE_ATTEMPTS:
                    raise
                logger.info("Tuner status write conflicted (attempt %d); reading again", attempt)
                fresh = await client.get(path)
                if fresh is None or _tuning_off(fresh):
                    return None
                window = await decided(fresh)
    if window.overrides_changed:
        # The Deployment is rendered from the spec and the overrides just written.
        await apply_owned(written or fresh)
    for event in window.events:
        emit(*event)
    return window.status["tuning"]


@dataclass(frozen=True)
class Window:
    """One window's outcome: the status patch to write, and what follows from it."""

    decision: Decision
    status: dict[str, Any]
    events: list[Event]
    overrides_changed: bool


def decide_window(llmd: dict[str, Any], observation: Observation, now: float) -> Window:
    """Pure: the LLMDeployment as read and one window's metrics in, the status patch out."""
    spec = with_defaults(llmd.get("spec") or {})
    mode, status = spec["tuning"]["mode"], llmd.get("status") or {}
    previous = status.get("tuning") or {}
    recorded = recorded_overrides(llmd)
    overrides, dropped = overrides_in_force(spec, llmd)
    state = TunerState.from_status(previous.get("state"))
    if state.pending is not None and state.pending.knob in dropped:
        state.pending = None  # the user's value replaced the change under watch
    settings, limits = current_settings(effective_spec(llmd)), limits_from_spec(spec)
    decision, state = decide(
        observation.snapshot,
        settings,
        limits,
        state,
        now=now,
        mode=mode,
        rollout_complete=rollout_complete(status, settings, observation.live),
        problem=observation.problem,
    )
    if mode == "Auto" and decision.action in ("change", "revert"):
        assert decision.knob is not None and decision.new is not None
        overrides = with_change(spec, overrides, decision.knob, decision.new)
    stamp = _rfc3339(now)
    tuning, events = tuning_status(
        previous,
        decision,
        state.to_status(),
        mode=mode,
        now=stamp,
        snapshot=observation.snapshot,
        settings=settings,
        fixed=limits.fixed,
    )
    tuning["overrides"] = overrides_patch(recorded, overrides) or None
    tuning["banned"] = [
        {"knob": ban.knob, "value": ban.value, "until": _rfc3339(ban.until)}
        for ban in state.rejected
    ] or None
    events = [
        ("Normal", "TuningOverrideReset", f"{knob}: {why}; the tuner's "
         f"{recorded[knob]['value']:g} no longer applies") for knob, why in dropped.items()
    ] + events  # fmt: skip
    condition = metrics_condition(observation.snapshot, observation.reason, observation.problem)
    events += condition_events(status.get("conditions") or [], condition)
    conditions = set_condition(status.get("conditions"), condition, stamp)
    return Window(
        decision,
        {"tuning": replacing(previous, tuning), "conditions": conditions},
        events,
        overrides_changed=overrides != recorded,
    )


def live_change(llmd: dict[str, Any], decision: Decision) -> tuple[str, float] | None:
    """(knob, value) when this decision sets an engine knob the engines may take live."""
    spec = with_defaults(llmd.get("spec") or {})
    if decision.action not in ("change", "revert") or decision.knob not in ENGINE_SETTINGS:
        return None
    if not live_enabled(spec) or decision.new is None:
        return None
    return decision.knob, decision.new


def with_live_outcome(window: Window, outcome: LiveOutcome) -> Window:
    """The window's status and Events with how its live change went: the override says
    whether it was applied live (one that was not rolls out by restart: the pod template
    changes, see ``live_settings.restart_hash``), and so do the decision and an Event."""
    decision = window.decision
    tuning = copy.deepcopy(window.status["tuning"])
    override = (tuning.get("overrides") or {}).get(decision.knob)
    if isinstance(override, dict):
        override["live"] = outcome.live
    decisions = tuning.get("decisions") or []
    if decisions and decisions[-1].get("knob") == decision.knob:
        decisions[-1]["applied"] = outcome.summary()
    change = f"{decision.knob} {fmt(decision.old)} -> {fmt(decision.new)}"
    if outcome.live:
        event = ("Normal", "TuningAppliedLive", f"{change}: {outcome.summary()}")
    else:
        event = ("Normal", "TuningRollingRestart",
                 f"{change} rolls out by restart: {outcome.summary()}")  # fmt: skip
    return dataclasses.replace(window, status={**window.status, "tuning": tuning},
                               events=[*window.events, event])  # fmt: skip


def replacing(before: Any, after: Any) -> Any:
    """A merge patch that leaves ``after`` where ``before`` is: ``after``, with a null for
    each key of ``before`` it lacks, at any depth. The status is written by merge patch
    (RFC 7386), which keeps a key the patch leaves out: without the nulls, a field of the
    last window (the knob of its decision, a verdict) would outlive it."""
    if not isinstance(before, dict) or not isinstance(after, dict):
        return after
    patch: dict[str, Any] = {key: None for key in before if key not in after}
    patch.update({key: replacing(before.get(key), value) for key, value in after.items()})
    return patch


class CredentialsError(Exception):
    """A Secret that ``spec.prometheus`` names is missing, or lacks the key."""


async def prometheus_endpoint(
    client: KubeClient, namespace: str, prometheus: dict[str, Any]
) -> PrometheusEndpoint:
    """``spec.prometheus`` with the bearer token and CA bundle read from their Secrets."""
    values = {}
    for field in ("bearerTokenSecretRef", "caSecretRef"):
        ref = prometheus.get(field)
        if ref:
            values[field] = await _secret_value(client, namespace, field, ref)
    return PrometheusEndpoint(
        prometheus["url"],
        bearer_token=(values.get("bearerTokenSecretRef") or "").strip() or None,
        ca_pem=values.get("caSecretRef"),
    )


async def _secret_value(client: KubeClient, namespace: str, field: str, ref: dict[str, str]) -> str:
    where = f"spec.prometheus.{field}: Secret {namespace}/{ref['name']}"
    try:
        secret = await client.get(f"/api/v1/namespaces/{namespace}/secrets/{ref['name']}")
    except KubeError as error:
        raise CredentialsError(f"{where}: {error.message}") from error
    if secret is None:
        raise CredentialsError(f"{where} not found")
    encoded = (secret.get("data") or {}).get(ref["key"])
    if encoded is None:
        raise CredentialsError(f"{where} has no key {ref['key']!r}")
    try:
        return base64.b64decode(encoded).decode()
    except (ValueError, UnicodeDecodeError) as error:
        raise CredentialsError(f"{where}, key {ref['key']!r}: not text ({error})") from error


def _version(llmd: dict[str, Any]) -> str | None:
    return (llmd.get("metadata") or {}).get("resourceVersion")


def _log_decision(logger: logging.Logger, decision: Decision) -> None:
    judged = decision.verdict not in (None, decision.reason)  # a revert says it already
    logger.info(
        "Tuner %s: %s%s",
        decision.action,
        decision.reason,
        f" (judged: {decision.verdict})" if judged else "",
    )


def _tuning_off(llmd: dict[str, Any]) -> bool:
    spec = with_defaults(llmd.get("spec") or {})
    return spec["tuning"]["mode"] == "Off" or bool(validate_spec(spec))


def _rfc3339(epoch_s: float) -> str:
    moment = datetime.datetime.fromtimestamp(epoch_s, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
