"""Before the engine reports ready, every attention variant an eager step can need has run
once (so a Triton compile never stalls a request): both query tilings and every split of
the KV range."""

from __future__ import annotations

import kernels
from tiny_models import build_tiny_model

from inference import LLM


def test_warm_up_runs_each_prefill_variant(tmp_path, monkeypatch):
    build_tiny_model(tmp_path, "llama")
    llm = LLM(str(tmp_path), max_model_len=256, max_num_batched_tokens=4096,
              num_kv_blocks=300, block_size=16)
    calls = []

    def record(q, *args, max_query_len=None, num_segments=None, **kwargs):
        calls.append((q.shape[0], num_segments))
        return q

    monkeypatch.setattr(kernels, "paged_attention", record)
    llm.engine.runner._warm_up_attention_variants()
    short = sorted(s for t, s in calls if t == 64)
    assert short == [1, 2, 4, 8, 16, 32, 64]
    long = [s for t, s in calls if t == 4096]
    assert long and long[0] == 1  # 128-row tiles: few splits, since 4096 tokens fill the GPU
