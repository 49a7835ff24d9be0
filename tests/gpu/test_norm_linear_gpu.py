"""The fused RMSNorm + GEMV (``kernels.rms_norm_linear``) compiled on the GPU (H200 suite):
on the Qwen2.5-1.5B and 7B layer shapes, at every M the dispatch fuses, against float64
and the unfused ops, the residual bit-equal to ``x + residual``, CUDA-graph replay on new
inputs equal to an eager call (``inference.bench.fusion_check``, without its timing)."""

from __future__ import annotations

import pytest
import torch

from inference.bench import fusion_check

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (H200 suite)"),
]


def test_fused_norm_gemv_on_model_shapes() -> None:
    with torch.no_grad():
        rows = fusion_check.kernel_checks(fusion_check.SHAPES, [1, 2, 4], torch.device("cuda"),
                                          timing=False)  # fmt: skip
    fused = {(row["shape"], row["proj"], row["m"]) for row in rows}
    assert {("1.5B", "qkv", 1), ("1.5B", "gate_up+silu", 1), ("7B", "qkv", 1)} <= fused
    bad = [row for row in rows if not row["ok"]]
    assert not bad, bad
