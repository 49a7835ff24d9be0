"""Benches on CPU default to the embedded model, and ``--plot DIR`` writes PNGs whose
titles state the workload that ran (not a fixed "512 in / 128 out")."""

from __future__ import annotations

import pytest

from inference.bench import plot
from inference.cli import build_parser


@pytest.fixture
def titles(monkeypatch) -> dict[str, list[str]]:
    """Each written plot's axes titles, by file name (the PNG itself is still written)."""
    seen: dict[str, list[str]] = {}
    save = plot._save

    def capture(fig, out):
        seen[out.name] = [ax.get_title() for ax in fig.axes] + [fig.get_suptitle()]
        return save(fig, out)

    monkeypatch.setattr(plot, "_save", capture)
    return seen


def test_latency_bench_on_cpu_runs_the_embedded_model_and_plots_it(tmp_path, titles, capsys):
    args = build_parser().parse_args([
        "bench", "latency", "--device", "cpu", "--input-len", "8", "--output-len", "3",
        "--batch-size", "1", "2", "--num-iters", "1", "--plot", str(tmp_path),
    ])  # fmt: skip
    assert args.func(args) == 0
    assert "model: default" in capsys.readouterr().out
    assert (tmp_path / "latency_sweep.png").stat().st_size > 1000
    assert "(8 in / 3 out)" in titles["latency_sweep.png"][0]
    assert "default" in titles["latency_sweep.png"][-1]


def test_throughput_and_serve_titles_state_their_workload(tmp_path, titles):
    throughput = {"workload": "throughput", "model": "m", "num_prompts": 64, "input_len": 32,
                  "output_len": 16, "output_tok_s": 100.0}
    serve = {"workload": "serve", "model": "m", "num_prompts": 10, "input_len": 100,
             "output_len": 20, "request_rate": 4.0,
             **{f"{m}_{s}_ms": 1.0 for m in ("ttft", "tpot", "itl", "e2e")
                for s in ("p50", "p90", "p99")}}
    written = plot.write_plots([throughput, serve], tmp_path)
    assert {p.name for p in written} == {"throughput.png", "serve_latency.png"}
    assert titles["throughput.png"][0] == "offline throughput: 64 prompts x 32 in / 16 out"
    assert "10 requests of 100 in / 20 out, rate 4.0 req/s" in titles["serve_latency.png"][0]


def test_latency_bench_sweeps_prompt_lengths_for_long_context(tmp_path, titles, capsys):
    """``--input-len`` takes several lengths (the long-context rows: TTFT of each prompt
    length, TPOT at that context); each runs at every batch size, and the plot's lines say
    which length they are."""
    out = tmp_path / "latency.json"
    args = build_parser().parse_args([
        "bench", "latency", "--device", "cpu", "--input-len", "4", "40", "--output-len", "3",
        "--batch-size", "1", "2", "--num-iters", "1", "--block-size", "16",
        "--output-json", str(out), "--plot", str(tmp_path),
    ])  # fmt: skip
    assert args.func(args) == 0
    import json

    rows = json.loads(out.read_text())
    rows = rows if isinstance(rows, list) else rows["results"]
    assert [(r["input_len"], r["batch_size"]) for r in rows] == [(4, 1), (4, 2), (40, 1), (40, 2)]
    printed = capsys.readouterr().out
    assert "in     40 out     3" in printed
    assert "4/40 in / 3 out" in titles["latency_sweep.png"][0]
