"""``python -m inference.bench.fp8_check --smoke``: the FP8 quality and speed check runs end
to end on CPU (tiny random model) and writes its record, so the GPU run is not the first
time its plumbing executes."""

from __future__ import annotations

import json
import math

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
    (speed,) = result["speed"].values()
    assert speed["latency_bf16"]["quantization"] is None
    assert speed["latency_fp8"]["quantization"] == "fp8"
    assert speed["throughput_fp8"]["quantization"] == "fp8"
    assert speed["batch1_speedup"] > 0 and speed["offline_speedup"] > 0
