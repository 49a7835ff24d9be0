"""Every approach on every trace at the product's defaults: a table, a JSON file and plots.

    cd operator && python -m pagoda_operator.tuning.sim.report --out tuning-results

Side by side, each from the same start (2 replicas and the engine's defaults:
``maxNumSeqs`` 1024, ``gpuMemoryUtilization`` 0.9) with the same
replica bounds, a look every 60 s, a 600 s cooldown and a Service's random spread:

- **tuned**: the operator's ``decide`` (Auto), all three knobs;
- **knobs-off**: the same with ``maxNumSeqs`` and ``gpuMemoryUtilization`` pinned (replicas
  only): the ablation that shows what the engine knobs add;
- **queue-autoscaler**: what ``autoscaling.enabled`` gives (HPA on prometheus-adapter, or
  KEDA): the HorizontalPodAutoscaler's algorithm on waiting requests per replica;
- **best static**: the fewest GPU-hours among maxNumSeqs x gpuMemoryUtilization, each with
  the fewest replicas that meet the SLO (TTFT p95 within target in >= 95 % of one-minute
  windows).

``--traces`` runs some of them; ``--no-static`` skips the static sweep (the slow part) while
iterating.
"""

from __future__ import annotations

import argparse
import json
import math
from concurrent.futures import ProcessPoolExecutor
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
STATIC_MAX_NUM_SEQS = (128, 256, 1024)
STATIC_GPU_MEMORY = (0.9, 0.95)
# The product's engine defaults on a GPU (maxNumSeqs left out resolves to 1024) on 2 replicas.
START = {REPLICAS: 2, MAX_NUM_SEQS: 1024, GPU_MEMORY_UTILIZATION: 0.9}
# The product's defaults (operator/README.md): one look a minute, a 10-minute cooldown, the
# Service's random spread, and the autoscaler's target of 4 waiting requests per replica.
INTERVAL_S = 60.0
COOLDOWN_S = 600.0
ROUTING = "random"
AUTOSCALER_PERIOD_S = 15.0  # the HPA controller's sync period
AUTOSCALER_TARGET_WAITING = 4.0
BOUNDS = {
    REPLICAS: (1, MAX_REPLICAS),
    MAX_NUM_SEQS: (16, 1024),
    GPU_MEMORY_UTILIZATION: (0.85, 0.95),  # the range the calibration bench measured
}
APPROACHES = ("tuned", "knobs-off", "queue-autoscaler")


def limits_for(trace: Trace, knobs: bool = True) -> Limits:
    """The user's limits: all three knobs, or replicas only (the knob-off ablation)."""
    if knobs:
        return Limits(bounds=BOUNDS, fixed={}, cooldown_s=COOLDOWN_S,
                      ttft_target_s=trace.ttft_target_s)  # fmt: skip
    return Limits(
        bounds={REPLICAS: BOUNDS[REPLICAS]},
        fixed={MAX_NUM_SEQS: "knob-off ablation", GPU_MEMORY_UTILIZATION: "knob-off ablation"},
        cooldown_s=COOLDOWN_S, ttft_target_s=trace.ttft_target_s,
    )  # fmt: skip


def meets_slo(result: Result) -> bool:
    return result.attainment >= SLO_ATTAINMENT


def run_static(trace_name: str, seqs: int, memory: float, replicas: int) -> dict[str, Any]:
    trace = TRACES[trace_name]()
    windows = int(trace.duration_s // SLO_WINDOW_S)
    allowed = math.floor((1 - SLO_ATTAINMENT) * windows)
    start = {REPLICAS: replicas, MAX_NUM_SEQS: seqs, GPU_MEMORY_UTILIZATION: memory}
    result = simulate(trace, start, interval_s=INTERVAL_S, give_up_misses=allowed + 1,
                      routing=ROUTING)  # fmt: skip
    return {"config": start, "gpu_hours": result.gpu_hours, "attainment": result.attainment,
            "preemptions": result.preemptions,
            "meets": meets_slo(result) and result.slo_windows == windows}  # fmt: skip


def best_static(trace_name: str, pool: ProcessPoolExecutor) -> tuple[dict | None, list[dict]]:
    """Per (maxNumSeqs, gpuMemoryUtilization), the fewest replicas that meet the SLO."""
    combos = [(s, m) for s in STATIC_MAX_NUM_SEQS for m in STATIC_GPU_MEMORY]
    replicas = {combo: 1 for combo in combos}
    found: dict[tuple[int, float], dict] = {}
    sweep: list[dict] = []
    while len(found) < len(combos):
        todo = [c for c in combos if c not in found and replicas[c] <= MAX_REPLICAS]
        if not todo:
            break
        rows = list(pool.map(run_static, [trace_name] * len(todo), *zip(*todo),
                             [replicas[c] for c in todo]))  # fmt: skip
        for combo, row in zip(todo, rows):
            sweep.append(row)
            if row["meets"]:
                found[combo] = row
            else:
                replicas[combo] += 1
    best = min(found.values(), key=lambda row: row["gpu_hours"], default=None)
    return best, sweep


def run_approach(trace_name: str, approach: str) -> Result:
    """One approach at the product's defaults (see the module's docstring)."""
    trace = TRACES[trace_name]()
    if approach == "queue-autoscaler":
        low, high = BOUNDS[REPLICAS]
        scaler = QueueAutoscaler(AUTOSCALER_TARGET_WAITING, int(low), int(high))
        return simulate(trace, START, autoscaler=scaler, interval_s=AUTOSCALER_PERIOD_S,
                        routing=ROUTING)  # fmt: skip
    limits = limits_for(trace, knobs=approach == "tuned")
    return simulate(trace, START, limits=limits, interval_s=INTERVAL_S, routing=ROUTING)


def summarize(result: Result) -> dict[str, Any]:
    line = result.timeline
    return {
        "attainment": result.attainment,
        "gpu_hours": result.gpu_hours,
        "preemptions": result.preemptions,
        "rollouts": result.rollouts,
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


def trace_row(trace_name: str, pool: ProcessPoolExecutor, static: bool) -> dict[str, Any]:
    runs = dict(zip(APPROACHES, pool.map(run_approach, [trace_name] * len(APPROACHES),
                                         APPROACHES)))  # fmt: skip
    trace = TRACES[trace_name]()
    row: dict[str, Any] = {"trace": trace_name, "description": trace.description,
                           "ttft_target_s": trace.ttft_target_s}  # fmt: skip
    row |= {name: summarize(result) for name, result in runs.items()}
    row["best_static"], row["sweep"] = best_static(trace_name, pool) if static else (None, [])
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


def plot(trace_name: str, trace: Trace, runs: dict[str, Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(5, 1, figsize=(10, 12), sharex=True)
    first = next(iter(runs.values())).timeline
    axes[0].plot([t / 60 for t in first.time], first.rate, color="gray")
    axes[0].set_ylabel("requests/s")
    axes[0].set_title(f"{trace_name}: {trace.description}")
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


def _describe(row: dict | None) -> str:
    if row is None:
        return "none meets the SLO"
    config = row["config"]
    return (f"{config[REPLICAS]} x maxNumSeqs {config[MAX_NUM_SEQS]}, "
            f"gpuMemoryUtilization {config[GPU_MEMORY_UTILIZATION]}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("tuning-results"))
    parser.add_argument("--traces", nargs="*", default=list(TRACES), choices=list(TRACES))
    parser.add_argument("--no-static", action="store_true", help="skip the static sweep")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with ProcessPoolExecutor(2) as pool:
        for name in args.traces:
            row, runs = trace_row(name, pool, static=not args.no_static)
            plot(name, TRACES[name](), runs, args.out / f"{name}.png")
            rows.append(row)
            print(*_rows(row), sep="\n", flush=True)
    results = {"calibration": _calibration(), "traces": rows}
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=float))
    (args.out / "results.md").write_text(_markdown(rows))
    return 0


def _calibration() -> dict[str, Any]:
    from pagoda_operator.tuning.sim.engine import engine_model

    model = engine_model("qwen2.5-7b")
    return {"model": model.name, "provisional": model.provisional,
            "decode_s": model.decode, "prefill_s": model.prefill,
            "kv_tokens_at_0.9": model.kv_capacity_tokens(0.9),
            "startup_s": model.startup_s}  # fmt: skip


def _rows(row: dict) -> list[str]:
    lines = []
    for name in APPROACHES:
        run = row[name]
        seqs = "-".join(str(v) for v in sorted(set(run["max_num_seqs_range"])))
        memory = "-".join(f"{v:g}" for v in sorted(set(run["gpu_memory_utilization_range"])))
        lines.append(
            f"| {row['trace']} | {name} | {run['attainment']:.1%} | {run['gpu_hours']:.2f} "
            f"| {run['preemptions']} | {run['rollouts']} | {seqs} | {memory} |"
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


def _markdown(rows: list[dict]) -> str:
    header = (
        "At the product's defaults (60 s looks, 600 s cooldown, random spread; the queue "
        "autoscaler on 4 waiting requests per replica every 15 s); Qwen2.5-7B shape on H200:\n\n"
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
    return header + body + "\n\n" + verdicts + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
