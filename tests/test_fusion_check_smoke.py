"""``python -m inference.bench.fusion_check --smoke``: the fused-norm GPU check runs end to
end on CPU (its kernel checks under Triton's interpreter, the fused/unfused latency runs on
a tiny random model) and writes its record, so the GPU run is not the first time its
plumbing executes."""

from __future__ import annotations

import json

from inference.bench import fusion_check


def test_smoke_run_writes_kernels_and_engine(tmp_path, monkeypatch) -> None:
    from kernels._triton import linear as triton_linear

    fused_launches = []
    original = triton_linear.rms_norm_linear

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        fused_launches.append(kwargs.get("gated", False))
        return original(*args, **kwargs)

    monkeypatch.setattr(triton_linear, "rms_norm_linear", spy)
    out = tmp_path / "fusion_check.json"
    argv = ["--smoke", "--ms", "1", "2", "--input-len", "16", "--output-len", "4",
            "--num-iters", "1", "--output-json", str(out)]  # fmt: skip
    assert fusion_check.main(argv) == 0
    assert sorted(set(fused_launches)) == [False, True]  # the kernel itself, both forms
    result = json.loads(out.read_text())
    assert result["workload"] == "fusion_check" and result["smoke"] and result["ok"]
    kernels_rows = result["kernels"]
    assert {(r["proj"], r["m"]) for r in kernels_rows} == {
        ("qkv", 1), ("qkv", 2), ("gate_up+silu", 1), ("gate_up+silu", 2)
    }
    assert all(r["rel_err_fused"] <= fusion_check.MAX_REL_ERR for r in kernels_rows)
    greedy = result["greedy"]
    assert 0.0 <= greedy["identical_fraction"] <= greedy["mean_common_prefix_fraction"] <= 1.0
    assert greedy["identical_fraction"] == 1.0  # on CPU both paths are the references
    (engine,) = result["engine"].values()
    assert engine["unfused"]["norm_fusion"] is False and engine["fused"]["norm_fusion"] is True
    assert engine["unfused"]["output_tok_s"] > 0 and engine["speedup"] > 0
