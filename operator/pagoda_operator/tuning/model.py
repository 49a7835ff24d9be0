"""The tuner's vocabulary: knob names, one window of metrics, the user's limits, the
policy's thresholds and its decision."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from pagoda_operator.overrides import (  # noqa: F401  (re-exported: the knobs' names)
    GPU_MEMORY_UTILIZATION,
    KNOBS,
    MAX_NUM_SEQS,
    REPLICAS,
)

Action = Literal["hold", "change", "revert"]


@dataclass(frozen=True)
class Snapshot:
    """One window of engine metrics for one LLMDeployment, over all its engines.

    Counts are totals over the engines (gauges averaged over the window); ``None`` means the
    quantity is unknown: no request finished in the window (latencies) or no
    kube-state-metrics series (restarts, OOM kills).
    """

    window_s: float
    pods: int
    kv_cache_usage: float
    requests_waiting: float
    requests_running: float
    preemptions_per_s: float
    ttft_p95_s: float | None
    itl_p95_s: float | None
    generation_tokens_per_s: float
    requests_per_s: float  # finished, not aborted
    restarts: float | None = None
    oom_kills: float | None = None
    aborted_per_s: float = 0.0  # requests clients gave up on
    queue_growth_per_s: float = 0.0  # change of requests_waiting over the window
    prompt_tokens_per_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        """The decision's inputs as status shows them: camelCase, rounded."""
        names = {
            "window_s": "windowSeconds",
            "pods": "pods",
            "kv_cache_usage": "kvCacheUsage",
            "requests_waiting": "requestsWaiting",
            "requests_running": "requestsRunning",
            "preemptions_per_s": "preemptionsPerSecond",
            "ttft_p95_s": "ttftP95Seconds",
            "itl_p95_s": "itlP95Seconds",
            "generation_tokens_per_s": "generationTokensPerSecond",
            "requests_per_s": "requestsPerSecond",
            "restarts": "restarts",
            "oom_kills": "oomKills",
            "aborted_per_s": "abortedPerSecond",
            "queue_growth_per_s": "queueGrowthPerSecond",
            "prompt_tokens_per_s": "promptTokensPerSecond",
        }
        return {names[key]: rounded(value) for key, value in asdict(self).items()}


@dataclass(frozen=True)
class Limits:
    """What the user allows: bounds of the knobs the tuner may move, and the SLO."""

    bounds: dict[str, tuple[float, float]]  # only the knobs the tuner may move
    fixed: dict[str, str]  # knob -> why the tuner leaves it alone
    cooldown_s: float
    ttft_target_s: float
    itl_target_s: float | None = None
    max_num_batched_tokens: int | None = None  # maxNumSeqs may not exceed it
    # A change whose rollout has not completed this long after it was made is reverted.
    rollout_deadline_s: float = 2100.0
    # Engines a change of maxNumSeqs or gpuMemoryUtilization takes out of service at once
    # while it rolls out (the Deployment's maxUnavailable; None: all of them, Recreate). A
    # rollout with a surge and maxUnavailable 0 starts each new engine before an old one
    # stops, and loses none.
    rollout_unavailable: int | None = 1
    # The engines take maxNumSeqs and gpuMemoryUtilization live (``tuning.live``): a change
    # costs a step or a CUDA-graph capture, no engine leaves service, so the rules need not
    # time it around a rollout (one that cannot be made live still rolls out by restart).
    engine_knobs_live: bool = False


@dataclass(frozen=True)
class PolicyConfig:
    """Thresholds of the rules; the defaults are the product's, tests may tighten them."""

    queue_per_pod: float = 1.0  # waiting requests per engine that count as a queue
    busy_fraction: float = 0.9  # running / maxNumSeqs at which batch slots are the limit
    kv_headroom: float = 0.75  # KV usage below which more sequences fit
    kv_bound: float = 0.9  # KV usage at which the cache, not the batch, is the limit
    kv_busy: float = 0.85  # KV usage that, sustained, adds replicas before the cache fills
    preemptions_per_pod_s: float = 0.05  # sustained preemption rate that calls for action
    idle_ttft_fraction: float = 0.5  # TTFT p95 below this share of the target is "idle"
    # TTFT p95 above this share of the target (and within it) is too close: one more engine.
    # Far enough from idle's share that ±20 % noise cannot trigger both.
    near_ttft_fraction: float = 0.8
    idle_queue_per_pod: float = 0.1
    scale_down_utilization: float = 0.6  # load per engine left after removing one
    busy_utilization: float = 0.92  # demand per engine, of its saturated rate: scale up early
    capacity_memory_cooldowns: float = 30.0  # how long a measured saturated rate is trusted
    prompt_shift_ratio: float = 2.0  # prompts this much longer or shorter void a measured rate
    # Batches of the saturated window and a later one at least this far apart (a share of
    # the first) fit the decode step that carries its rate to a new maxNumSeqs.
    step_fit_spread: float = 0.25
    scale_up_utilization: float = 0.85  # share of an engine's saturated rate to plan for
    max_scale_up_factor: float = 3.0
    windows_up: int = 2
    aborts_per_pod_s: float = 0.5  # requests given up on that skip the hysteresis
    severe_ttft_factor: float = 5.0  # TTFT p95 this far over target skips it too
    windows_down: int = 4
    windows_preempting: int = 3
    # Preemptions this frequent (per engine) are a storm: one window is enough to act.
    storm_preemptions_per_pod_s: float = 0.5
    worse_ratio: float = 1.5  # TTFT p95 this many times the baseline, above target: worse
    worse_throughput_ratio: float = 0.65  # tokens/s below this share of the baseline: worse
    worse_margin_s: float = 0.05
    reversal_dwell_cooldowns: float = 2.0
    reject_cooldowns: float = 10.0
    oom_memory_cooldowns: float = 10.0
    max_num_seqs_factor: float = 2.0
    # A raise of maxNumSeqs smaller than this (a rolling restart for a few slots) is not made.
    min_max_num_seqs_raise: float = 1.25
    gpu_memory_step: float = 0.02


DEFAULT_CONFIG = PolicyConfig()


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    knob: str | None = None
    old: float | None = None
    new: float | None = None
    # How the change under watch turned out, when this window judged it.
    verdict: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None}


@dataclass(frozen=True)
class Proposal:
    knob: str
    new: float
    reason: str
    # Engines to add, and have Ready, before this engine-knob change rolls out, so that as
    # many serve through its rollout as before it (see cover.cover_engines).
    cover: int = 0


def direction(old: float, new: float) -> int:
    return (new > old) - (new < old)


def fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:g}"


def rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.4g}")
    return value
