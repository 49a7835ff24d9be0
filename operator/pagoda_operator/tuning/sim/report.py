"""Tuned vs the best static configuration on every trace: a table, a JSON file and plots.

    python -m pagoda_operator.tuning.sim.report --out operator/tuning-results

The best static configuration of a trace is the one with the fewest GPU-hours among those
that meet the SLO (TTFT p95 within target in at least 95 % of one-minute windows), found
by sweeping maxNumSeqs x gpuMemoryUtilization and, for each, the fewest replicas that meet
it. The tuned run starts from a modest configuration and has the whole trace to adapt.

The first table runs the tuner every 30 s with a 120 s cooldown behind least-outstanding
routing. The second runs everything at the product's defaults (a look every 60 s, a 600 s
cooldown, a Service's random spread) side by side: the tuner, the tuner with its engine
knobs pinned (replicas only: the knob-off ablation), the queue-driven autoscaler the
product also offers (HPA or KEDA on waiting requests, target 4 per replica, the same
replica bounds, 15 s period) and the best static configuration under that routing.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from pagoda_operator.tuning.sim.traces import TRACES

SLO_ATTAINMENT = 0.95
TTFT_TARGET_S = 1.0
INTERVAL_S = 30.0
COOLDOWN_S = 120.0  # > 40 s start-up: a change is judged only once its replicas serve
MAX_REPLICAS = 12
STATIC_MAX_NUM_SEQS = (64, 128, 256)
STATIC_GPU_MEMORY = (0.9, 0.94)
TUNED_START = {REPLICAS: 2, MAX_NUM_SEQS: 256, GPU_MEMORY_UTILIZATION: 0.9}
LIMITS = Limits(
    bounds={
        REPLICAS: (1, MAX_REPLICAS),
        MAX_NUM_SEQS: (32, 256),
        GPU_MEMORY_UTILIZATION: (0.85, 0.97),
    },
    fixed={},
    cooldown_s=COOLDOWN_S,
    ttft_target_s=TTFT_TARGET_S,
)


# The product's defaults (operator/README.md): one look a minute, a 10-minute cooldown, the
# Service's random spread, and the autoscaler's target of 4 waiting requests per replica.
PRODUCT_INTERVAL_S = 60.0
PRODUCT_COOLDOWN_S = 600.0
PRODUCT_ROUTING = "random"
AUTOSCALER_PERIOD_S = 15.0  # the HPA controller's sync period
AUTOSCALER_TARGET_WAITING = 4.0
PRODUCT_LIMITS = dataclasses.replace(LIMITS, cooldown_s=PRODUCT_COOLDOWN_S)
KNOBS_OFF_LIMITS = dataclasses.replace(
    PRODUCT_LIMITS,
    bounds={REPLICAS: LIMITS.bounds[REPLICAS]},
    fixed={MAX_NUM_SEQS: "knob-off ablation", GPU_MEMORY_UTILIZATION: "knob-off ablation"},
)


def meets_slo(result: Result) -> bool:
    return result.attainment >= SLO_ATTAINMENT


def run_static(
    trace_name: str, seqs: int, memory: float, replicas: int, routing: str = "least-outstanding"
) -> dict[str, Any]:
    trace = TRACES[trace_name]()
    windows = int(trace.duration_s // SLO_WINDOW_S)
    allowed = math.floor((1 - SLO_ATTAINMENT) * windows)
    start = {REPLICAS: replicas, MAX_NUM_SEQS: seqs, GPU_MEMORY_UTILIZATION: memory}
    result = simulate(trace, start, interval_s=INTERVAL_S, ttft_target_s=TTFT_TARGET_S,
                      give_up_misses=allowed + 1, routing=routing)  # fmt: skip
    return {"config": start, "gpu_hours": result.gpu_hours, "attainment": result.attainment,
            "preemptions": result.preemptions,
            "meets": meets_slo(result) and result.slo_windows == windows}  # fmt: skip


def best_static(
    trace_name: str, pool: ProcessPoolExecutor, routing: str = "least-outstanding"
) -> tuple[dict | None, list[dict]]:
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
                             [replicas[c] for c in todo], [routing] * len(todo)))  # fmt: skip
        for combo, row in zip(todo, rows):
            sweep.append(row)
            if row["meets"]:
                found[combo] = row
            else:
                replicas[combo] += 1
    best = min(found.values(), key=lambda row: row["gpu_hours"], default=None)
    return best, sweep


def run_tuned(trace_name: str) -> Result:
    trace = TRACES[trace_name]()
    return simulate(trace, TUNED_START, limits=LIMITS, interval_s=INTERVAL_S,
                    ttft_target_s=TTFT_TARGET_S)  # fmt: skip


def run_at_defaults(trace_name: str, approach: str) -> Result:
    """One approach at the product's defaults (see the module's docstring)."""
    trace = TRACES[trace_name]()
    common = {"ttft_target_s": TTFT_TARGET_S, "routing": PRODUCT_ROUTING}
    if approach == "queue-autoscaler":
        low, high = LIMITS.bounds[REPLICAS]
        scaler = QueueAutoscaler(AUTOSCALER_TARGET_WAITING, int(low), int(high))
        return simulate(trace, TUNED_START, autoscaler=scaler, interval_s=AUTOSCALER_PERIOD_S,
                        **common)  # fmt: skip
    limits = PRODUCT_LIMITS if approach == "tuned" else KNOBS_OFF_LIMITS
    return simulate(trace, TUNED_START, limits=limits, interval_s=PRODUCT_INTERVAL_S, **common)


DEFAULTS_APPROACHES = ("tuned", "knobs-off", "queue-autoscaler")


def defaults_rows(trace_name: str, pool: ProcessPoolExecutor) -> dict[str, Any]:
    runs = dict(zip(DEFAULTS_APPROACHES, pool.map(
        run_at_defaults, [trace_name] * len(DEFAULTS_APPROACHES), DEFAULTS_APPROACHES)))  # fmt: skip
    best, _ = best_static(trace_name, pool, PRODUCT_ROUTING)
    row: dict[str, Any] = {
        name: {
            "attainment": result.attainment,
            "gpu_hours": result.gpu_hours,
            "preemptions": result.preemptions,
            "rollouts": result.rollouts,
            "max_num_seqs_range": [min(result.timeline.max_num_seqs),
                                   max(result.timeline.max_num_seqs)],  # fmt: skip
            "decisions": result.timeline.decisions,
        }
        for name, result in runs.items()
    }
    row["best_static"] = best
    row["runs"] = runs
    return row


def plot(trace_name: str, tuned: Result, best: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    line = tuned.timeline
    minutes = [t / 60 for t in line.time]
    fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    axes[0].plot(minutes, line.rate, color="gray")
    axes[0].set_ylabel("requests/s")
    axes[0].set_title(f"{trace_name}: tuned vs best static ({_describe(best)})")
    axes[1].step(minutes, line.replicas, where="post", label="tuned (incl. starting)")
    if best is not None:
        axes[1].axhline(best["config"][REPLICAS], color="tab:red", ls="--", label="best static")
    axes[1].set_ylabel("replicas (GPUs)")
    axes[1].legend(loc="upper left")
    axes[2].step(minutes, line.max_num_seqs, where="post", color="tab:green")
    axes[2].set_ylabel("maxNumSeqs", color="tab:green")
    twin = axes[2].twinx()
    twin.step(minutes, line.gpu_memory_utilization, where="post", color="tab:purple")
    twin.set_ylabel("gpuMemoryUtilization", color="tab:purple")
    axes[3].plot(minutes, line.ttft_p95_s, color="tab:blue", label="TTFT p95 (30 s windows)")
    axes[3].axhline(TTFT_TARGET_S, color="tab:red", ls="--", label="target")
    axes[3].set_yscale("log")
    axes[3].set_ylabel("seconds")
    axes[3].set_xlabel("minutes")
    axes[3].legend(loc="upper left")
    for decision in line.decisions:
        if decision["action"] != "hold":
            for axis in axes[1:3]:
                axis.axvline(decision["time"] / 60, color="black", alpha=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_defaults(trace_name: str, runs: dict[str, Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    axes[0].set_title(f"{trace_name} at the product's defaults (60 s looks, 600 s cooldown)")
    for name, result in runs.items():
        line = result.timeline
        minutes = [t / 60 for t in line.time]
        axes[0].step(minutes, line.replicas, where="post", label=name)
        axes[1].step(minutes, line.max_num_seqs, where="post", label=name)
        axes[2].plot(minutes, line.ttft_p95_s, label=name, alpha=0.8)
    axes[0].set_ylabel("replicas (GPUs)")
    axes[0].legend(loc="upper left")
    axes[1].set_ylabel("maxNumSeqs")
    axes[2].axhline(TTFT_TARGET_S, color="tab:red", ls="--")
    axes[2].set_yscale("log")
    axes[2].set_ylabel("TTFT p95 (s)")
    axes[2].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _describe(row: dict | None) -> str:
    if row is None:
        return "none meets the SLO"
    config = row["config"]
    return (f"{config[REPLICAS]} x maxNumSeqs {config[MAX_NUM_SEQS]}, "
            f"gpuMemoryUtilization {config[GPU_MEMORY_UTILIZATION]}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("operator/tuning-results"))
    parser.add_argument("--traces", nargs="*", default=list(TRACES))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    summary, defaults = [], []
    with ProcessPoolExecutor(2) as pool:
        tuned_runs = dict(zip(args.traces, pool.map(run_tuned, args.traces)))
        for name in args.traces:
            best, sweep = best_static(name, pool)
            tuned = tuned_runs[name]
            plot(name, tuned, best, args.out / f"{name}.png")
            row = {
                "trace": name,
                "description": TRACES[name]().description,
                "tuned": {
                    "attainment": tuned.attainment,
                    "gpu_hours": tuned.gpu_hours,
                    "decisions": tuned.timeline.decisions,
                },  # fmt: skip
                "best_static": best,
                "sweep": sweep,
            }
            row["passes"] = bool(
                best is not None
                and meets_slo(tuned)
                and tuned.gpu_hours <= best["gpu_hours"] + 1e-9
            )
            summary.append(row)
            print(_table_row(row), flush=True)
        for name in args.traces:
            at_defaults = defaults_rows(name, pool)
            plot_defaults(name, at_defaults.pop("runs"), args.out / f"{name}-defaults.png")
            defaults.append({"trace": name, **at_defaults})
            print(*_defaults_rows(defaults[-1]), sep="\n", flush=True)
    results = {"fast_tuner": summary, "product_defaults": defaults}
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=float))
    (args.out / "results.md").write_text(_markdown(summary) + "\n" + _defaults_markdown(defaults))
    return 0 if all(row["passes"] for row in summary) else 1


def _table_row(row: dict) -> str:
    best = row["best_static"]
    static_hours = "n/a" if best is None else f"{best['gpu_hours']:.2f}"
    return (
        f"| {row['trace']} | {row['tuned']['attainment']:.1%} | {row['tuned']['gpu_hours']:.2f} "
        f"| {_describe(best)} | {static_hours} | {'yes' if row['passes'] else 'NO'} |"
    )


def _markdown(summary: list[dict]) -> str:
    header = (
        "| trace | tuned: SLO windows met | tuned: GPU-hours | best static | "
        "static: GPU-hours | tuned meets SLO with <= GPU-hours |\n|---|---|---|---|---|---|\n"
    )
    return header + "\n".join(_table_row(row) for row in summary) + "\n"


def _defaults_rows(row: dict) -> list[str]:
    lines = []
    for name in DEFAULTS_APPROACHES:
        run = row[name]
        seqs = "-".join(str(v) for v in sorted(set(run["max_num_seqs_range"])))
        lines.append(
            f"| {row['trace']} | {name} | {run['attainment']:.1%} | {run['gpu_hours']:.2f} "
            f"| {run['preemptions']} | {run['rollouts']} | {seqs} |"
        )
    best = row["best_static"]
    if best is None:
        lines.append(f"| {row['trace']} | best static | none meets the SLO | | | 0 | |")
    else:
        lines.append(
            f"| {row['trace']} | best static: {_describe(best)} | {best['attainment']:.1%} "
            f"| {best['gpu_hours']:.2f} | {best['preemptions']} | 0 "
            f"| {best['config'][MAX_NUM_SEQS]} |"
        )
    return lines


def _defaults_markdown(defaults: list[dict]) -> str:
    header = (
        "At the product's defaults (60 s looks, 600 s cooldown, random spread; the queue "
        "autoscaler on 4 waiting requests per replica every 15 s):\n\n"
        "| trace | approach | SLO windows met | GPU-hours | preemptions | rollouts | "
        "maxNumSeqs |\n|---|---|---|---|---|---|---|\n"
    )
    return header + "\n".join(line for row in defaults for line in _defaults_rows(row)) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
