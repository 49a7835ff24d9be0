"""``python -m inference.bench.fp8_check --smoke``: the FP8 quality and speed check runs end
to end on CPU (tiny random model) and writes its record, so the GPU run is not the first
time its plumbing executes; its perplexity agrees with a forward pass outside the engine."""

from __future__ import annotations

import json
import math

import pytest
import torch

from inference.bench import fp8_check


def test_smoke_run_writes_quality_and_speed(tmp_path) -> None:
    out = tmp_path / "fp8_check.json"
    assert fp8_check.main(["--smoke", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["workload"] == "fp8_check" and result["smoke"] and result["commit"]
    (quality,) = result["quality"]
    assert quality["model"] == "random-qwen2-realistic"
    greedy, forced = quality["greedy"], quality["teacher_forced"]
    assert 0.0 <= greedy["identical_fraction"] <= greedy["mean_common_prefix_fraction"] <= 1.0
    assert math.isfinite(forced["mean_kl"]) and forced["mean_kl"] >= 0.0
    assert 0.5 <= forced["argmax_agreement"] <= 1.0 and forced["positions"] > 0
    ppl = quality["perplexity"]
    assert ppl["reference"] > 1.0 and ppl["fp8"] > 1.0 and "pydoc_data.topics" in ppl["text"]
    assert ppl["relative_increase"] == pytest.approx(ppl["fp8"] / ppl["reference"] - 1, abs=1e-3)
    # 256 tokens in windows of 64: each window's first token is not predicted.
    assert ppl["tokens"] == 256 - 4
    (speed,) = result["speed"].values()
    assert speed["latency_bf16"]["quantization"] is None
    assert speed["latency_fp8"]["quantization"] == "fp8"
    assert speed["throughput_fp8"]["quantization"] == "fp8"
    assert speed["batch1_speedup"] > 0 and speed["offline_speedup"] > 0


def test_perplexity_windows_are_fixed_english_text() -> None:
    windows = fp8_check.perplexity_windows(None, False, 1000, 300)
    assert [len(w) for w in windows][:3] == [300, 300, 300] and sum(map(len, windows)) == 1000
    text = bytes(sum(windows, [])).decode(errors="replace")
    assert "assert" in text and text == bytes(
        sum(fp8_check.perplexity_windows(None, False, 1000, 300), [])
    ).decode(errors="replace")


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_engine_perplexity_matches_a_full_forward(tmp_path, quantization) -> None:
    """The engine's prompt logprobs (what fp8_check scores perplexity with) against the
    log-softmax of one forward pass of the same model outside the engine."""
    folder = tmp_path / "model"
    fp8_check.write_realistic_model(folder, fp8_check.SMOKE_CONFIG)
    windows = fp8_check.perplexity_windows(folder, False, 160, 64)
    engine = {"dtype": "float32", "max_model_len": 128, "device": "cpu"}
    _, nll, count = fp8_check._engine_pass(folder, [[5, 6, 7]], 1, windows, engine, quantization)
    full = fp8_check._full_logprobs(folder, windows, torch.float32, torch.device("cpu"),
                                    quantization)  # fmt: skip
    expected = -sum(lp[torch.arange(len(w) - 1), w[1:]].sum().item()
                    for lp, w in zip(full, windows, strict=True))  # fmt: skip
    assert count == 160 - len(windows)
    assert nll == pytest.approx(expected, rel=1e-4)
