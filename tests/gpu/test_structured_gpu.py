"""Structured outputs on a CUDA GPU: masks filled ahead of the launch (on their own thread,
in page-locked memory) give the tokens of masks filled inside it, with CUDA graphs and
async scheduling, through arrivals, an abort and preemption."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from structured_workload import ARRIVALS, run_fill_ahead_workload
from tiny_models import build_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (H200 suite)"),
    pytest.mark.skipif(importlib.util.find_spec("llguidance") is None,
                       reason="llguidance is not installed"),
]


def test_masks_filled_ahead_on_a_gpu(tmp_path):
    build_tiny_model(tmp_path, "llama")
    settings = dict(device="cuda", block_size=16, num_kv_blocks=12)
    with_ahead, fills, preempted = run_fill_ahead_workload(str(tmp_path), True, **settings)
    in_launch, _, _ = run_fill_ahead_workload(str(tmp_path), False, **settings)
    assert with_ahead == in_launch
    assert len(with_ahead) == sum(ARRIVALS.values())
    assert fills["ahead"] > 10 and fills["taken"] >= fills["ahead"] - 2
    print(f"\nfills {fills}, preempted {preempted}")
