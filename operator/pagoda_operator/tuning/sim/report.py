"""Every approach on every trace, from three starts: a table, a JSON file and plots.

    cd operator && python -m pagoda_operator.tuning.sim.report --out tuning-results

The four starts (``SETUPS``): the product's defaults (the engine's resolved defaults,
``maxNumSeqs`` 1024 and ``gpuMemoryUtilization`` 0.9, the tuner's default cooldown), the
shipped autoscaled GPU sample (``manifests/samples/llmdeployment-gpu-autoscaled.yaml``:
``maxNumSeqs`` 256, its tuning bounds, batch budget and cooldown, and its autoscaler's
target), and the same sample
with ``spec.rollout`` maxSurge 1 and maxUnavailable 0 (a knob change rolls out on a spare
GPU, without taking an engine away), and the same sample with engine-knob changes made
live (the engines' admin API, as the operator does in Auto: one engine at a time takes the
change, after a step, or once the CUDA graphs a larger batch needs are captured in the
background, steps going on meanwhile; a KV resize stalls it for a full capture; none
restarts). In each, side
by side from the same start with the same replica bounds, a look every 60 s and a
Service's random spread:

- **tuned**: the operator's ``decide`` (Auto), all three knobs;
- **knobs-off**: the same with ``maxNumSeqs`` and ``gpuMemoryUtilization`` pinned (replicas
  only): the ablation that shows what the engine knobs add;
- **queue-autoscaler**: what ``autoscaling.enabled`` gives (HPA on prometheus-adapter, or
  KEDA): the HorizontalPodAutoscaler's algorithm on waiting requests per replica;
- **best static**: the fewest GPU-hours among maxNumSeqs x gpuMemoryUtilization, each with
  the fewest replicas that meet the SLO (TTFT p95 within target in >= 95 % of one-minute
  windows).

``--setups`` and ``--traces`` run some of them; ``--no-static`` skips the static sweep (the slow part) while
iterating.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda_operator.tuning.policy import (
    GPU_MEMORY_UTILIZATION,
    MAX_NUM_SEQS,
    REPLICAS,
    Limits,
)
from pagoda_operator.tuning.sim.cluster import SLO_WINDOW_S, QueueAutoscaler, Result, simulate
from pagoda_operator.tuning.sim.traces import TRACES, Trace

SLO_ATTAINMENT = 0.95
MAX_REPLICAS = 12
# The product's defaults (operator/README.md): one look a minute and the Service's random
# spread; the HPA controller's sync period.
INTERVAL_S = 60.0
ROUTING = "random"
AUTOSCALER_PERIOD_S = 15.0
APPROACHES = ("tuned", "knobs-off", "queue-autoscaler")


@dataclass(frozen=True)
class Setup:
    """Where every approach starts, and the user's settings it runs under."""

    name: str
    description: str
    start: dict[str, float]
    bounds: dict[str, tuple[float, float]]  # the tuner's; replicas' bound the autoscaler too
    cooldown_s: float
    autoscaler_target_waiting: float
    static_max_num_seqs: tuple[int, ...]  # the best static configuration is sought among
    static_gpu_memory: tuple[float, ...]  # these x these, each with the fewest replicas
    max_num_batched_tokens: int | None = None  # None: the engine's (the bench's) budget
    max_surge: int = 0  # spec.rollout; the product's default rolls out one engine at a time,
    max_unavailable: int = 1  # stopping each before its successor starts
    live: bool = False  # engine-knob changes made in the running engines (the admin API)


SETUPS = {
    "defaults": Setup(
        "defaults",
        "the product's defaults: maxNumSeqs left out (the engine resolves 1024 on a GPU), "
        "gpuMemoryUtilization 0.9, the tuner's 600 s cooldown, the autoscaler's target of 4 "
        "waiting requests per replica",
        start={REPLICAS: 2, MAX_NUM_SEQS: 1024, GPU_MEMORY_UTILIZATION: 0.9},
        bounds={
            REPLICAS: (1, MAX_REPLICAS),
            MAX_NUM_SEQS: (16, 1024),
            GPU_MEMORY_UTILIZATION: (0.85, 0.95),
        },
        cooldown_s=600.0,
        autoscaler_target_waiting=4.0,
        static_max_num_seqs=(128, 256, 1024),
        static_gpu_memory=(0.9, 0.95),
    ),
    # manifests/samples/llmdeployment-gpu-autoscaled.yaml as shipped
    # (tests/tuning/test_simulator.py checks these against it): engine.maxNumSeqs 256, gpuMemoryUtilization 0.9,
    # maxNumBatchedTokens 8192, tuning.bounds, tuning.cooldownSeconds 900, and
    # autoscaling.targetRequestsWaiting 8. Not taken from it: its tensorParallelSize 2 (the
    # engine is calibrated on one H200, which holds a 7B) and its replica bounds 2-4 (with
    # them no approach serves the burst's or the diurnal peak; the same 1-12 as above).
    "gpu-sample": Setup(
        "gpu-sample",
        "the shipped GPU sample: maxNumSeqs 256, gpuMemoryUtilization 0.9, "
        "maxNumBatchedTokens 8192, tuning bounds maxNumSeqs 64-512 and gpuMemoryUtilization "
        "0.8-0.95, a 900 s cooldown, the autoscaler's target of 8 waiting requests per replica",
        start={REPLICAS: 2, MAX_NUM_SEQS: 256, GPU_MEMORY_UTILIZATION: 0.9},
        bounds={
            REPLICAS: (1, MAX_REPLICAS),
            MAX_NUM_SEQS: (64, 512),
            GPU_MEMORY_UTILIZATION: (0.8, 0.95),
        },
        cooldown_s=900.0,
        autoscaler_target_waiting=8.0,
        static_max_num_seqs=(64, 256, 512),
        static_gpu_memory=(0.9, 0.95),
        max_num_batched_tokens=8192,
    ),
}
# The same sample with spec.rollout {maxSurge: 1, maxUnavailable: 0}: a user with one
# spare GPU's worth of headroom, whose knob changes roll out without losing an engine.
SETUPS["gpu-sample-surge"] = dataclasses.replace(
    SETUPS["gpu-sample"],
    name="gpu-sample-surge",
    description=SETUPS["gpu-sample"].description.replace(
        "the shipped GPU sample: ",
        "the shipped GPU sample with spec.rollout maxSurge 1 and maxUnavailable 0 (each new "
        "engine starts on a spare GPU before an old one stops): ",
    ),
    max_surge=1,
    max_unavailable=0,
)
# The same sample with engine-knob changes made live (the admin API, as the operator does
# in Auto): a batch raised past the captured graphs waits for the missing ones, captured
# in the background while the engine steps on under the old limits (their share of the
# 14.5 s measured at start-up); a KV resize stalls the engine for a full capture, anything
# else for a step; no engine restarts and none leaves service.
SETUPS["gpu-sample-live"] = dataclasses.replace(
    SETUPS["gpu-sample"],
    name="gpu-sample-live",
    description=SETUPS["gpu-sample"].description.replace(
        "the shipped GPU sample: ",
        "the shipped GPU sample with engine-knob changes made live (the admin API: graphs "
        "for a larger batch captured in the background, no restart): ",
    ),
    live=True,
)
DEFAULTS = SETUPS["defaults"]
START = DEFAULTS.start


def limits_for(trace: Trace, knobs: bool = True, setup: Setup = DEFAULTS) -> Limits:
    """The user's limits: all three knobs, or replicas only (the knob-off ablation)."""
    common = dict(cooldown_s=setup.cooldown_s, ttft_target_s=trace.ttft_target_s,
                  max_num_batched_tokens=setup.max_num_batched_tokens,
                  rollout_unavailable=setup.max_unavailable,
                  engine_knobs_live=setup.live)  # fmt: skip
    if knobs:
        return Limits(bounds=setup.bounds, fixed={}, **common)
    return Limits(
        bounds={REPLICAS: setup.bounds[REPLICAS]},
        fixed={MAX_NUM_SEQS: "knob-off ablation", GPU_MEMORY_UTILIZATION: "knob-off ablation"},
        **common,
    )


def meets_slo(result: Result) -> bool:
    return result.attainment >= SLO_ATTAINMENT


def run_static(
    setup_name: str, trace_name: str, seqs: int, memory: float, replicas: int
) -> dict[str, Any]:
    trace = TRACES[trace_name]()
    windows = int(trace.duration_s // SLO_WINDOW_S)
    allowed = math.floor((1 - SLO_ATTAINMENT) * windows)
    start = {REPLICAS: replicas, MAX_NUM_SEQS: seqs, GPU_MEMORY_UTILIZATION: memory}
    result = simulate(trace, start, interval_s=INTERVAL_S, give_up_misses=allowed + 1,
                      routing=ROUTING,
                      max_num_batched_tokens=SETUPS[setup_name].max_num_batched_tokens)  # fmt: skip
    return {"config": start, "gpu_hours": result.gpu_hours, "attainment": result.attainment,
            "preemptions": result.preemptions,
            "meets": meets_slo(result) and result.slo_windows == windows}  # fmt: skip


def best_static(
    setup: Setup, trace_name: str, pool: ProcessPoolExecutor
) -> tuple[dict | None, list[dict]]:
    """Per (maxNumSeqs, gpuMemoryUtilization), the fewest replicas that meet the SLO."""
    combos = [(s, m) for s in setup.static_max_num_seqs for m in setup.static_gpu_memory]
    replicas = {combo: 1 for combo in combos}
    found: dict[tuple[int, float], dict] = {}
    sweep: list[dict] = []
    while len(found) < len(combos):
        todo = [c for c in combos if c not in found and replicas[c] <= MAX_REPLICAS]
        if not todo:
            break
        rows = list(pool.map(run_static, [setup.name] * len(todo), [trace_name] * len(todo),
                             *zip(*todo),
                             [replicas[c] for c in todo]))  # fmt: skip
        for combo, row in zip(todo, rows):
            sweep.append(row)
            if row["meets"]:
                found[combo] = row
            else:
                replicas[combo] += 1
    best = min(found.values(), key=lambda row: row["gpu_hours"], default=None)
    return best, sweep


def run_approach(setup_name: str, trace_name: str, approach: str) -> Result:
    """One approach from one setup's start (see the module's docstring)."""
    setup, trace = SETUPS[setup_name], TRACES[trace_name]()
    common = dict(routing=ROUTING, max_num_batched_tokens=setup.max_num_batched_tokens,
                  max_surge=setup.max_surge, max_unavailable=setup.max_unavailable)  # fmt: skip
    if approach == "queue-autoscaler":
        low, high = setup.bounds[REPLICAS]
        scaler = QueueAutoscaler(setup.autoscaler_target_waiting, int(low), int(high))
        return simulate(trace, setup.start, autoscaler=scaler, interval_s=AUTOSCALER_PERIOD_S,
                        **common)  # fmt: skip
    limits = limits_for(trace, knobs=approach == "tuned", setup=setup)
    return simulate(trace, setup.start, limits=limits, interval_s=INTERVAL_S, live=setup.live,
                    **common)  # fmt: skip


def summarize(result: Result) -> dict[str, Any]:
    line = result.timeline
    return {
        "attainment": result.attainment,
        "gpu_hours": result.gpu_hours,
        "preemptions": result.preemptions,
        "rollouts": result.rollouts,
        "live_changes": result.live_changes,
        "live_stall_s": result.live_stall_s,
        "dropped": result.dropped,
        "max_num_seqs_range": [min(line.max_num_seqs), max(line.max_num_seqs)],
        "gpu_memory_utilization_range": [min(line.gpu_memory_utilization),
                                         max(line.gpu_memory_utilization)],  # fmt: skip
        "probe_misses": probe_misses(result),
        "decisions": line.decisions,
    }


def probe_misses(result: Result) -> int:
    """Intervals whose TTFT p95 broke the target right after a change that took capacity
    away (fewer replicas, a lower maxNumSeqs or gpuMemoryUtilization): the SLO broken to
    probe."""
    line = result.timeline
    cuts = [d["time"] for d in line.decisions
            if d["action"] == "change" and d.get("new", 0) < d.get("old", 0)]  # fmt: skip
    misses = 0
    for time, ttft in zip(line.time, line.ttft_p95_s):
        recent_cut = any(0 < time - cut <= 2 * SLO_WINDOW_S + INTERVAL_S for cut in cuts)
        misses += recent_cut and ttft > line.ttft_target_s
    return misses


def static_key(setup: Setup, trace_name: str) -> tuple:
    """What a static sweep depends on: a static configuration never rolls out, so starts
    that differ only in spec.rollout share one."""
    return (trace_name, setup.static_max_num_seqs, setup.static_gpu_memory,
            setup.max_num_batched_tokens)  # fmt: skip


def trace_row(
    setup: Setup,
    trace_name: str,
    pool: ProcessPoolExecutor,
    static: bool,
    sweeps: dict[tuple, tuple[dict | None, list[dict]]] | None = None,
) -> tuple[dict[str, Any], dict[str, Result]]:
    count = len(APPROACHES)
    runs = dict(zip(APPROACHES, pool.map(run_approach, [setup.name] * count,
                                         [trace_name] * count, APPROACHES)))  # fmt: skip
    trace = TRACES[trace_name]()
    row: dict[str, Any] = {"trace": trace_name, "description": trace.description,
                           "ttft_target_s": trace.ttft_target_s}  # fmt: skip
    row |= {name: summarize(result) for name, result in runs.items()}
    sweeps = {} if sweeps is None else sweeps
    key = static_key(setup, trace_name)
    if static and key not in sweeps:
        sweeps[key] = best_static(setup, trace_name, pool)
    row["best_static"], row["sweep"] = sweeps[key] if static else (None, [])
    tuned, off, queue = (row[name] for name in APPROACHES)
    row["target_met"] = bool(
        tuned["attainment"] >= SLO_ATTAINMENT
        and tuned["probe_misses"] == 0
        and tuned["gpu_hours"] <= queue["gpu_hours"] + 1e-9
    )
    # The engine knobs made the difference: the tuned run meets the SLO where the knob-off
    # run does not, or meets it as the knob-off run does with fewer GPU-hours.
    row["knobs_decide"] = bool(
        tuned["attainment"] >= SLO_ATTAINMENT
        and (off["attainment"] < SLO_ATTAINMENT or tuned["gpu_hours"] < 0.97 * off["gpu_hours"])
        and tuned["max_num_seqs_range"] + tuned["gpu_memory_utilization_range"]
        != off["max_num_seqs_range"] + off["gpu_memory_utilization_range"]
    )
    return row, runs


def plot(
    setup: Setup, trace_name: str, trace: Trace, runs: dict[str, Result], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(5, 1, figsize=(10, 12), sharex=True)
    first = next(iter(runs.values())).timeline
    axes[0].plot([t / 60 for t in first.time], first.rate, color="gray")
    axes[0].set_ylabel("requests/s")
    axes[0].set_title(f"{trace_name} from {setup.name}: {trace.description}", fontsize=9)
    for name, result in runs.items():
        line = result.timeline
        minutes = [t / 60 for t in line.time]
        axes[1].step(minutes, line.replicas, where="post", label=name)
        axes[2].step(minutes, line.max_num_seqs, where="post", label=name)
        axes[3].step(minutes, line.gpu_memory_utilization, where="post", label=name)
        axes[4].plot(minutes, line.ttft_p95_s, label=name, alpha=0.8)
    axes[1].set_ylabel("replicas (GPUs)")
    axes[1].legend(loc="upper left")
    axes[2].set_ylabel("maxNumSeqs")
    axes[3].set_ylabel("gpuMemoryUtilization")
    axes[4].axhline(trace.ttft_target_s, color="tab:red", ls="--", label="target")
    axes[4].set_yscale("log")
    axes[4].set_ylabel("TTFT p95 (s)")
    axes[4].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("tuning-results"))
    parser.add_argument("--setups", nargs="*", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument("--traces", nargs="*", default=list(TRACES), choices=list(TRACES))
    parser.add_argument("--no-static", action="store_true", help="skip the static sweep")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    setups = []
    sweeps: dict[tuple, tuple[dict | None, list[dict]]] = {}
    with ProcessPoolExecutor(2) as pool:
        for setup in (SETUPS[name] for name in args.setups):
            rows = []
            for name in args.traces:
                row, runs = trace_row(setup, name, pool, not args.no_static, sweeps)
                plot(setup, name, TRACES[name](), runs, args.out / plot_name(setup, name))
                rows.append(row)
                print(*_rows(row), sep="\n", flush=True)
            setups.append({"setup": setup.name, "description": setup.description,
                           "start": setup.start, "bounds": setup.bounds,
                           "cooldown_s": setup.cooldown_s,
                           "autoscaler_target_waiting": setup.autoscaler_target_waiting,
                           "max_num_batched_tokens": setup.max_num_batched_tokens,
                           "rollout": {"maxSurge": setup.max_surge,
                                       "maxUnavailable": setup.max_unavailable},
                           "live": setup.live, "traces": rows})  # fmt: skip
    results = {"calibration": _calibration(), "setups": setups}
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=float))
    (args.out / "results.md").write_text(_markdown(setups))
    return 0


def plot_name(setup: Setup, trace_name: str) -> str:
    return f"{setup.name}-{trace_name}.png"


def _calibration() -> dict[str, Any]:
    from pagoda_operator.tuning.sim.engine import engine_model

    model = engine_model("qwen2.5-7b")
    return {"model": model.name, "provisional": model.provisional,
            "decode_s": model.decode, "prefill_s": model.prefill,
            "kv_tokens_at_0.9": model.kv_capacity_tokens(0.9),
            "startup_s": model.startup_s, "capture_s": model.capture_s}  # fmt: skip


def _rows(row: dict) -> list[str]:
    lines = []
    for name in APPROACHES:
        run = row[name]
        seqs = "-".join(str(v) for v in sorted(set(run["max_num_seqs_range"])))
        memory = "-".join(f"{v:g}" for v in sorted(set(run["gpu_memory_utilization_range"])))
        live = run.get("live_changes", 0)
        rollouts = f"{run['rollouts']}" + (f" (+{live} live)" if live else "")
        lines.append(
            f"| {row['trace']} | {name} | {run['attainment']:.1%} | {run['gpu_hours']:.2f} "
            f"| {run['preemptions']} | {rollouts} | {seqs} | {memory} |"
        )
    best = row["best_static"]
    if best is None:
        lines.append(f"| {row['trace']} | best static | {'none meets the SLO' if row['sweep'] else 'not run'} | | | 0 | | |")
    else:
        config = best["config"]
        lines.append(
            f"| {row['trace']} | best static: {config[REPLICAS]} replicas | "
            f"{best['attainment']:.1%} | {best['gpu_hours']:.2f} | {best['preemptions']} | 0 "
            f"| {config[MAX_NUM_SEQS]} | {config[GPU_MEMORY_UTILIZATION]:g} |"
        )
    return lines


def _markdown(setups: list[dict]) -> str:
    parts = []
    for setup in setups:
        rows = setup["traces"]
        header = (
            f"## From {setup['description']}\n\n"
            "60 s looks, random spread; the queue autoscaler every 15 s; replicas 1-12; "
            f"rollouts with maxSurge {setup['rollout']['maxSurge']} and maxUnavailable "
            f"{setup['rollout']['maxUnavailable']}; Qwen2.5-7B shape on one H200 a replica:\n\n"
            "| trace | approach | SLO windows met | GPU-hours | preemptions | rollouts | "
            "maxNumSeqs | gpuMemoryUtilization |\n|---|---|---|---|---|---|---|---|\n"
        )
        body = "\n".join(line for row in rows for line in _rows(row))
        verdicts = "\n".join(
            f"- {row['trace']} (TTFT p95 target {row['ttft_target_s']:g} s): target "
            f"{'met' if row['target_met'] else 'MISSED'}; engine knobs "
            f"{'made the difference' if row['knobs_decide'] else 'did not make the difference'}"
            for row in rows
        )
        parts.append(header + body + "\n\n" + verdicts + "\n")
    return "\n".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
