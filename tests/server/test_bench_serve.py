"""`pagoda bench serve` against a real server: Poisson and burst arrivals, text and token-id
prompts, both endpoints; the result JSON carries every field the published numbers need."""

from __future__ import annotations

import json
import math

import pytest

from inference.bench.serve import add_bench_serve_args, arrival_delays, percentile, run_bench_serve

FIELDS = [
    "workload", "model", "num_prompts", "input_len", "output_len", "request_rate",
    "duration_s", "request_throughput", "output_tok_s", "total_tok_s", "hardware", "commit",
    "command",
] + [f"{m}_p{q}_ms" for m in ("ttft", "tpot", "itl", "e2e") for q in (50, 90, 99)]  # fmt: skip


def bench(tmp_path, base_url: str, *extra: str) -> dict:
    import argparse

    out = tmp_path / "result.json"
    parser = add_bench_serve_args(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--base-url", base_url, "--output-json", str(out), "--num-prompts", "12", *extra]
    )
    assert run_bench_serve(args) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "extra",
    [
        ("--request-rate", "20", "--token-ids", "--vocab-size", "300", "--save-detailed"),
        ("--request-rate", "inf", "--endpoint", "chat", "--random-range-ratio", "0.5"),
        ("--request-rate", "inf", "--num-clients", "3", "--token-ids", "--vocab-size", "300",
         "--save-detailed"),
    ],
    ids=["poisson-token-ids", "burst-chat-text", "burst-3-client-processes"],
)
def test_bench_serve_reports_all_fields(tiny_server, tmp_path, capsys, extra):
    result = bench(
        tmp_path, tiny_server.base_url, "--input-len", "32", "--output-len", "16", *extra
    )
    for field in FIELDS:
        assert result.get(field) is not None, field
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["model"] == "tiny"
    if "--token-ids" in extra:
        # Exact lengths: 12 prompts of 32 token ids, 16 tokens each (ignore_eos).
        assert result["total_prompt_tokens"] == 12 * 32
        assert result["total_output_tokens"] == 12 * 16
    assert result["ttft_p50_ms"] <= result["ttft_p99_ms"] <= result["e2e_p99_ms"]
    assert result["output_tok_s"] > 0
    assert result["num_clients"] == (3 if "--num-clients" in extra else 1)
    assert "Output throughput" in capsys.readouterr().out
    if "--save-detailed" in extra:
        requests = result["requests"]
        assert len(requests) == 12 and all(r["ok"] for r in requests)
        # ITL is per streamed chunk: one a token, fewer where the server merged the steps
        # queued for a lagging stream (or drafts were accepted) into one chunk.
        assert all(len(r["itl_ms"]) <= r["output_tokens"] - 1 for r in requests)
        assert all(r["ttft_ms"] + sum(r["itl_ms"]) <= r["e2e_ms"] + 0.05 for r in requests)
        assert all(r["ttft_ms"] <= r["e2e_ms"] and r["start_time"] > 0 for r in requests)
    else:
        assert "requests" not in result


def test_bench_serve_counts_failures(tiny_server, tmp_path):
    import argparse

    parser = add_bench_serve_args(argparse.ArgumentParser())
    args = parser.parse_args([
        "--base-url", tiny_server.base_url, "--num-prompts", "3", "--model", "nope",
        "--input-len", "8", "--output-len", "4", "--output-json", str(tmp_path / "r.json"),
    ])  # fmt: skip
    assert run_bench_serve(args) == 1
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["failed"] == 3 and "404" in result["errors"][0]


def test_poisson_arrivals_are_seeded_and_have_the_right_rate():
    delays = arrival_delays(20000, 32.0, seed=5)
    assert delays == arrival_delays(20000, 32.0, seed=5)
    assert sum(delays) / len(delays) == pytest.approx(1 / 32.0, rel=0.05)
    assert arrival_delays(5, math.inf, seed=5) == [0.0] * 5


def test_percentile_interpolates_like_numpy():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 99) == pytest.approx(3.97)
    assert math.isnan(percentile([], 50))
