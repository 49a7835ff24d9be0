"""The simulator's calibration bench runs end to end on CPU (``--smoke``, a tiny random
shape): every section of the JSON the operator's simulator reads is there and sane."""

import json

from benchmarks.sim_calibration import add_sim_calibration_args, run_sim_calibration
from inference.bench.common import bench_main


def test_smoke_run_writes_every_section(tmp_path):
    out = tmp_path / "calibration.json"
    assert bench_main(add_sim_calibration_args, run_sim_calibration, "sim_calibration",
                      ["--smoke", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["workload"] == "sim_calibration" and result["smoke"] is True
    model = result["models"]["smoke"]
    assert [row["gpu_memory_utilization"] for row in model["kv_capacity"]] == [0.8, 0.9, 0.95]
    assert all(row["tokens"] == row["blocks"] * model["block_size"] > 0
               for row in model["kv_capacity"])
    # Every (batch, context) is either timed or skipped with a reason.
    timed = {(row["batch"], row["context"]) for row in model["decode"]}
    skipped = {(row["batch"], row["context"]) for row in model["decode_skipped"]}
    assert timed | skipped == {(b, c) for b in (1, 4, 8) for c in (32, 256)}
    assert not timed & skipped
    assert all(row["step_ms"] > 0 for row in model["decode"])
    assert {(row["chunk"], row["mode"]) for row in model["prefill"]} == {
        (c, m) for c in (32, 128) for m in ("single", "packed")}
    assert all(row["tokens_s"] > 0 for row in model["prefill"])
    assert [row["context"] for row in model["recompute"]] == [64, 256]
    assert model["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # K and V, layers, heads, dim, fp32
    assert model["recapture_s"] == 0.0  # no CUDA graphs on CPU: nothing recorded again


def test_the_simulator_takes_a_measured_recapture_over_the_start_up_capture():
    """A live KV resize stalls for every graph recorded again in the running engine, whose
    kernels are compiled: the calibration's ``recapture_s`` where it has one; the start-up
    capture (compiles included) only without it."""
    from pathlib import Path

    from pagoda_operator.tuning.sim import engine as sim_engine

    data = json.loads(Path(sim_engine.__file__).with_name("sim_calibration_h200.json")
                      .read_text())  # fmt: skip
    name = "qwen2.5-7b"
    measured = data["models"][name]
    start_up = measured["startup_phases"]["capture_s"]
    assert sim_engine.fit(name, measured).capture_s == start_up
    assert sim_engine.fit(name, measured | {"recapture_s": 3.0}).capture_s == 3.0
