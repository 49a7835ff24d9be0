"""One tuner window for one LLMDeployment: observe, decide, apply (Auto), record.

The only tuning module that does I/O; every decision comes from ``policy`` and every status
field from ``record``.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pagoda_operator.kube import MERGE_PATCH_CONTENT_TYPE, KubeClient
from pagoda_operator.reconcile import EmitEvent, llmd_path
from pagoda_operator.spec import validate_spec, with_defaults
from pagoda_operator.status import set_condition
from pagoda_operator.tuning.knobs import (
    current_settings,
    limits_from_spec,
    rollout_complete,
    spec_patch,
)
from pagoda_operator.tuning.policy import decide
from pagoda_operator.tuning.prometheus import Observation, observe
from pagoda_operator.tuning.record import condition_events, metrics_condition, tuning_status

INTERVAL_ENV = "PAGODA_TUNING_INTERVAL_SECONDS"
WINDOW_ENV = "PAGODA_TUNING_WINDOW_SECONDS"
DEFAULT_INTERVAL_SECONDS = 60.0

Observe = Callable[[str, str, str, float], Awaitable[Observation]]


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
    observe_fn: Observe = observe,
    clock: Callable[[], float] = time.time,
) -> dict[str, Any] | None:
    """Runs one window; returns the ``status.tuning`` it wrote (None when tuning is off)."""
    spec = with_defaults(llmd.get("spec") or {})
    mode = spec["tuning"]["mode"]
    if mode == "Off" or validate_spec(spec):
        return None  # an invalid spec is reconcile's to report
    meta, status = llmd["metadata"], llmd.get("status") or {}
    settings, limits = current_settings(spec), limits_from_spec(spec)
    previous = status.get("tuning") or {}
    observation = await observe_fn(
        spec["prometheus"]["url"], meta["namespace"], meta["name"], window_s
    )
    now = clock()
    decision, state = decide(
        observation.snapshot,
        settings,
        limits,
        previous.get("state"),
        now=now,
        mode=mode,
        rollout_complete=rollout_complete(status, settings, observation.live),
        problem=observation.problem,
    )
    logger.info("Tuner %s: %s", decision.action, decision.reason)
    if mode == "Auto" and decision.action in ("change", "revert"):
        assert decision.knob is not None and decision.new is not None
        await client.request(
            "PATCH",
            llmd_path(llmd),
            body={"spec": spec_patch(decision.knob, decision.new)},
            content_type=MERGE_PATCH_CONTENT_TYPE,
        )
    stamp = _rfc3339(now)
    tuning, events = tuning_status(
        previous,
        decision,
        state,
        mode=mode,
        now=stamp,
        snapshot=observation.snapshot,
        settings=settings,
        fixed=limits.fixed,
    )
    condition = metrics_condition(observation.snapshot, observation.reason, observation.problem)
    events += condition_events(status.get("conditions") or [], condition)
    conditions = set_condition(status.get("conditions"), condition, stamp)
    await client.patch_status(llmd_path(llmd), {"tuning": tuning, "conditions": conditions})
    for event in events:
        emit(*event)
    return tuning


def _rfc3339(epoch_s: float) -> str:
    moment = datetime.datetime.fromtimestamp(epoch_s, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
