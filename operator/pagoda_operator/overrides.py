"""The tuner's values next to the user's spec: what the engines run is the spec with the
overrides still in force.

The tuner never writes ``spec``: ``kubectl apply`` of the user's manifest, or a GitOps
controller (Argo CD, Flux), would put the user's values back, restart every engine, and fight
the tuner forever. Instead it records each value it set in ``status.tuning.overrides``,
together with the spec value it overrode, and the Deployment is rendered from the spec with
those overrides. An override holds only while

- ``spec.tuning.mode`` is ``Auto``,
- the spec still says the value it overrode (a user's change to a knob wins, and resets the
  tuner's override of it),
- the knob is not in ``spec.tuning.pinned``, and, for replicas, no autoscaler owns them.

Pure: plain dicts in, plain dicts out.
"""

from __future__ import annotations

from typing import Any

from pagoda_operator.spec import with_defaults

REPLICAS = "replicas"
MAX_NUM_SEQS = "maxNumSeqs"
GPU_MEMORY_UTILIZATION = "gpuMemoryUtilization"
KNOBS = (REPLICAS, MAX_NUM_SEQS, GPU_MEMORY_UTILIZATION)


def spec_value(spec: dict[str, Any], knob: str) -> float:
    """The knob's value in a defaulted spec."""
    if knob == REPLICAS:
        return int(spec["replicas"])
    if knob == MAX_NUM_SEQS:
        return int(spec["engine"]["maxNumSeqs"])
    if knob == GPU_MEMORY_UTILIZATION:
        return float(spec["engine"]["gpuMemoryUtilization"])
    raise ValueError(f"not a tunable knob: {knob}")


def typed(knob: str, value: float) -> float:
    """Counts are ints, the memory fraction a float."""
    return float(value) if knob == GPU_MEMORY_UTILIZATION else int(value)


def settings_of(spec: dict[str, Any]) -> dict[str, float]:
    """Every knob's value in a defaulted spec."""
    return {knob: spec_value(spec, knob) for knob in KNOBS}


def recorded_overrides(llmd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``status.tuning.overrides`` as written: knob -> {value, specValue}."""
    tuning = (llmd.get("status") or {}).get("tuning") or {}
    return {
        knob: dict(entry)
        for knob, entry in (tuning.get("overrides") or {}).items()
        if knob in KNOBS and isinstance(entry, dict) and "value" in entry
    }


def why_inactive(spec: dict[str, Any], knob: str, override: dict[str, Any]) -> str | None:
    """Why an override no longer applies to this defaulted spec, or None when it does."""
    tuning = spec["tuning"]
    if tuning["mode"] != "Auto":
        return f"spec.tuning.mode is {tuning['mode']}"
    if knob in (tuning.get("pinned") or []):
        return f"{knob} is pinned"
    if knob == REPLICAS and spec["autoscaling"]["enabled"]:
        return "the autoscaler owns replicas"
    if _differs(override.get("specValue"), spec_value(spec, knob)):
        return f"spec changed {knob} to {spec_value(spec, knob):g}"
    return None


def active_overrides(spec: dict[str, Any], llmd: dict[str, Any]) -> dict[str, float]:
    """The recorded overrides that hold for this defaulted spec: knob -> value."""
    return {
        knob: typed(knob, override["value"])
        for knob, override in recorded_overrides(llmd).items()
        if why_inactive(spec, knob, override) is None
    }


def effective_spec(llmd: dict[str, Any]) -> dict[str, Any]:
    """The defaulted spec with the tuner's overrides in force: what the engines should run."""
    spec = with_defaults(llmd.get("spec") or {})
    for knob, value in active_overrides(spec, llmd).items():
        if knob == REPLICAS:
            spec["replicas"] = value
        else:
            spec["engine"][knob] = value
    return spec


def _differs(recorded: Any, current: float) -> bool:
    try:
        return abs(float(recorded) - current) > 1e-9
    except (TypeError, ValueError):
        return True
