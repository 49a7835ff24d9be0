"""Plots from bench JSON: batch size vs output throughput and TPOT (latency sweeps),
written as PNG next to the results. ``python -m inference.bench.plot results/*.json``."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def plot_latency_sweeps(paths: list[Path], out: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    for path in paths:
        data = json.loads(path.read_text())
        for r in data if isinstance(data, list) else [data]:
            if r.get("workload") == "latency":
                label = f"{r.get('engine', 'pagoda')} {r['model']} out={r['output_len']} [{path.stem}]"
                series[label].append((r["batch_size"], r["output_tok_s"], r["tpot_ms"]))
    series = {label: points for label, points in series.items() if len(points) > 1}
    if not series:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, points in sorted(series.items()):
        points.sort()
        batch = [p[0] for p in points]
        ax1.plot(batch, [p[1] for p in points], marker="o", label=label)
        ax2.plot(batch, [p[2] for p in points], marker="o", label=label)
    for ax, ylabel in ((ax1, "output tokens/s"), (ax2, "TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (requests at once)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    ax1.set_title("throughput vs batch size (512 in / 128 out)")
    ax2.set_title("time per output token vs batch size")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def plot_output_length_sweep(paths: list[Path], out: Path) -> Path | None:
    """Batch-1 end-to-end latency against output length, one line per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for path in paths:
        data = json.loads(path.read_text())
        for r in data if isinstance(data, list) else [data]:
            if r.get("workload") == "latency" and r["batch_size"] == 1:
                series[r["model"]].append((r["output_len"], r["latency_s"] * 1e3))
    series = {m: sorted(set(p)) for m, p in series.items() if len({x[0] for x in p}) > 1}
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for model, points in sorted(series.items()):
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=model)
    ax.set_xlabel("output tokens (batch 1, 512-token prompt)")
    ax.set_ylabel("end-to-end latency (ms)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (argv if argv is not None else sys.argv[1:])]
    if not paths:
        print("usage: python -m inference.bench.plot RESULT.json ...", file=sys.stderr)
        return 2
    folder = paths[0].parent
    for out in (plot_latency_sweeps(paths, folder / "latency_sweep.png"),
                plot_output_length_sweep(paths, folder / "output_length_sweep.png")):
        print(out or "nothing to plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
