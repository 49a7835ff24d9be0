"""From an LLMDeployment to the tuner's view of it, and back.

Which knobs the tuner may move, in which range, the SLO it aims for, the values running now
(the spec with the overrides in force), and the overrides after one change: the tuner's
changes live in ``status.tuning.overrides``, never in the spec (see ``overrides``).
"""

from __future__ import annotations

from typing import Any

from pagoda_operator.desired import rollout_strategy
from pagoda_operator.live_settings import live_enabled
from pagoda_operator.overrides import (
    recorded_overrides,
    settings_of,
    spec_value,
    typed,
    why_inactive,
)
from pagoda_operator.tuning.policy import (
    GPU_MEMORY_UTILIZATION,
    KNOBS,
    MAX_NUM_SEQS,
    REPLICAS,
    Limits,
)

# Ranges for knobs the user gave no bounds for: wide enough to matter, narrow enough that
# no single setting in them is reckless (0.95 leaves the CUDA context and NCCL room).
DEFAULT_BOUNDS: dict[str, tuple[float, float]] = {
    MAX_NUM_SEQS: (1, 1024),
    GPU_MEMORY_UTILIZATION: (0.5, 0.95),
}
DEFAULT_TTFT_P95_SECONDS = 1.0
# Beyond the model load the spec allows: scheduling, the image (already on the node for a
# knob change) and a window or two of metrics.
ROLLOUT_DEADLINE_MARGIN_SECONDS = 300


def current_settings(effective_spec: dict[str, Any]) -> dict[str, float]:
    """The values the engines should run: the spec with the overrides in force."""
    return settings_of(effective_spec)


def limits_from_spec(spec: dict[str, Any]) -> Limits:
    tuning = spec.get("tuning") or {}
    autoscaling = spec["autoscaling"]
    pinned = set(tuning.get("pinned") or [])
    fixed = {knob: "pinned in spec.tuning.pinned" for knob in KNOBS if knob in pinned}
    if autoscaling["enabled"] and REPLICAS not in fixed:
        fixed[REPLICAS] = "the HorizontalPodAutoscaler owns replicas (autoscaling.enabled)"
    user_bounds = tuning.get("bounds") or {}
    bounds: dict[str, tuple[float, float]] = {}
    for knob in KNOBS:
        if knob in fixed:
            continue
        if knob == REPLICAS:
            low, high = autoscaling["minReplicas"], autoscaling["maxReplicas"]
        else:
            given = user_bounds.get(knob) or {}
            default_low, default_high = DEFAULT_BOUNDS[knob]
            low, high = given.get("min", default_low), given.get("max", default_high)
        if low >= high:
            fixed[knob] = f"its bounds allow a single value ({low:g})"
            continue
        bounds[knob] = (low, high)
    slo = tuning.get("slo") or {}
    return Limits(
        bounds=bounds,
        fixed=fixed,
        cooldown_s=float(tuning.get("cooldownSeconds", 600)),
        ttft_target_s=float(slo.get("ttftP95Seconds", DEFAULT_TTFT_P95_SECONDS)),
        itl_target_s=slo.get("itlP95Seconds"),
        max_num_batched_tokens=spec["engine"].get("maxNumBatchedTokens"),
        rollout_deadline_s=float(
            tuning.get("rolloutDeadlineSeconds")
            or int(spec["startupTimeoutSeconds"]) + ROLLOUT_DEADLINE_MARGIN_SECONDS
        ),
        rollout_unavailable=rollout_unavailable(spec),
        # A tensor-parallel engine takes only lower batch limits live: its raises restart.
        engine_knobs_live=live_enabled(spec) and int(spec["engine"]["tensorParallelSize"]) == 1,
    )


def rollout_unavailable(spec: dict[str, Any]) -> int | None:
    """Engines the Deployment's rollout takes out of service at once (None: all of them,
    Recreate), as the Deployment is rendered (maxUnavailable 1 by default, 0 with a surge
    and none given)."""
    strategy = rollout_strategy(spec)
    if strategy["type"] == "Recreate":
        return None
    return int(strategy["rollingUpdate"]["maxUnavailable"])


def overrides_in_force(
    spec: dict[str, Any], llmd: dict[str, Any]
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The recorded overrides that still hold for this defaulted spec, and why each of the
    others was dropped (knob -> reason)."""
    kept, dropped = {}, {}
    for knob, override in recorded_overrides(llmd).items():
        reason = why_inactive(spec, knob, override)
        if reason is None:
            kept[knob] = override
        else:
            dropped[knob] = reason
    return kept, dropped


def with_change(
    spec: dict[str, Any], overrides: dict[str, dict[str, Any]], knob: str, value: float
) -> dict[str, dict[str, Any]]:
    """The overrides after the tuner sets ``knob`` to ``value``; a value equal to the spec's
    is no override at all."""
    result = {name: dict(entry) for name, entry in overrides.items() if name != knob}
    user_value = spec_value(spec, knob)
    if abs(float(value) - user_value) > 1e-9:
        result[knob] = {"value": typed(knob, value), "specValue": user_value}
    return result


def overrides_patch(
    before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """The merge patch of ``status.tuning.overrides`` from ``before`` to ``after``."""
    return {**{knob: None for knob in before if knob not in after}, **after}


def rollout_complete(
    status: dict[str, Any], settings: dict[str, float], live: list[dict[str, str]]
) -> bool:
    """Whether the Deployment and every engine Prometheus sees run the spec's settings.

    ``live`` are the label sets of the engines' ``pagoda:engine_config_info`` series; a pod
    still loading, or an old one still draining, shows up there as a count or a value that
    does not match.
    """
    replicas = settings[REPLICAS]
    counts_ok = (
        int(status.get("updatedReplicas") or 0) >= replicas
        and int(status.get("readyReplicas") or 0) >= replicas
        and int(status.get("replicas") or 0) <= replicas
    )
    if not counts_ok or len(live) != replicas:
        return False
    for labels in live:
        try:
            seqs = int(labels.get("max_num_seqs", ""))
            memory = float(labels.get("gpu_memory_utilization", ""))
        except ValueError:
            return False
        if seqs != settings[MAX_NUM_SEQS] or abs(memory - settings[GPU_MEMORY_UTILIZATION]) > 1e-6:
            return False
    return True
