"""Plots of bench results, as PNG; every title states the workload that was run (model,
prompt and output lengths, batch sizes or request counts), read from the records.

``pagoda bench latency|throughput|serve --plot DIR`` writes them for the run just made;
``python -m inference.bench.plot results/*.json`` draws the published results (next to them).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

Record = dict[str, Any]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _values(records: list[Record], key: str) -> str:
    """A field's values across the records, as a title shows them ("512" or "128/256")."""
    return "/".join(str(v) for v in sorted({r[key] for r in records if key in r}))


def _models(records: list[Record]) -> str:
    return ", ".join(sorted({str(r.get("model")) for r in records}))


def load_records(paths: list[Path]) -> list[Record]:
    records: list[Record] = []
    for path in paths:
        data = json.loads(path.read_text())
        for r in data if isinstance(data, list) else [data]:
            records.append({**r, "_source": path.stem})
    return records


def plot_latency_sweeps(records: list[Record], out: Path) -> Path | None:
    """Output throughput and TPOT against batch size, one line per model and output length
    (and prompt length, where several ran)."""
    latency = [r for r in records if r.get("workload") == "latency"]
    series: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    several_inputs = len({r.get("input_len") for r in latency}) > 1  # a long-context sweep
    for r in latency:
        label = f"{r.get('engine', 'pagoda')} {r['model']} out={r['output_len']}"
        if several_inputs:
            label += f" in={r['input_len']}"
        if r.get("_source"):
            label += f" [{r['_source']}]"
        series[label].append((r["batch_size"], r["output_tok_s"], r["tpot_ms"]))
    if not series:
        return None
    plt = _pyplot()
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
    workload = f"{_values(latency, 'input_len')} in / {_values(latency, 'output_len')} out"
    ax1.set_title(f"throughput vs batch size ({workload})")
    ax2.set_title(f"time per output token vs batch size ({workload})")
    fig.suptitle(_models(latency), fontsize=9)
    return _save(fig, out)


def plot_output_length_sweep(records: list[Record], out: Path) -> Path | None:
    """Batch-1 end-to-end latency against output length, one line per model."""
    batch1 = [r for r in records if r.get("workload") == "latency" and r["batch_size"] == 1]
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in batch1:
        series[r["model"]].append((r["output_len"], r["latency_s"] * 1e3))
    series = {m: sorted(set(p)) for m, p in series.items() if len({x[0] for x in p}) > 1}
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for model, points in sorted(series.items()):
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=model)
    ax.set_xlabel(f"output tokens (batch 1, {_values(batch1, 'input_len')}-token prompt)")
    ax.set_ylabel("end-to-end latency (ms)")
    ax.set_title("latency vs output length")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, out)


def plot_throughput(records: list[Record], out: Path) -> Path | None:
    """Offline output tokens/s of each engine that ran the workload (pagoda, its peer)."""
    runs = [r for r in records if r.get("workload") == "throughput"]
    if not runs:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [f"{r.get('engine', 'pagoda')}\n{r['model']}" for r in runs]
    ax.bar(labels, [r["output_tok_s"] for r in runs])
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"offline throughput: {_values(runs, 'num_prompts')} prompts x "
                 f"{_values(runs, 'input_len')} in / {_values(runs, 'output_len')} out")
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, out)


def plot_serve_latency(records: list[Record], out: Path) -> Path | None:
    """TTFT, TPOT, ITL and end-to-end percentiles of a serving run."""
    runs = [r for r in records if r.get("workload") == "serve"]
    if not runs:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    stats, width = ("p50", "p90", "p99"), 0.8 / len(runs)
    metrics = ("ttft", "tpot", "itl", "e2e")
    for i, r in enumerate(runs):
        for j, stat in enumerate(stats):
            values = [r.get(f"{m}_{stat}_ms") or 0.0 for m in metrics]
            xs = [k + i * width + j * width / len(stats) for k in range(len(metrics))]
            ax.bar(xs, values, width / len(stats), label=f"{stat} {r['model']}")
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(metrics))], ["TTFT", "TPOT", "ITL", "E2E"])
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    rates = _values(runs, "request_rate")
    ax.set_title(f"serving: {_values(runs, 'num_prompts')} requests of "
                 f"{_values(runs, 'input_len')} in / {_values(runs, 'output_len')} out, "
                 f"rate {rates} req/s", fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, out)


def _save(fig, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return out


PLOTS = {
    "latency_sweep.png": plot_latency_sweeps,
    "output_length_sweep.png": plot_output_length_sweep,
    "throughput.png": plot_throughput,
    "serve_latency.png": plot_serve_latency,
}


def write_plots(records: list[Record], folder: str | Path) -> list[Path]:
    """Every plot the records make, as PNGs in ``folder``; returns their paths."""
    written = [plot(records, Path(folder) / name) for name, plot in PLOTS.items()]
    return [path for path in written if path is not None]


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (argv if argv is not None else sys.argv[1:])]
    if not paths:
        print("usage: python -m inference.bench.plot RESULT.json ...", file=sys.stderr)
        return 2
    for out in write_plots(load_records(paths), paths[0].parent) or ["nothing to plot"]:
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
