"""Before the engine reports ready, every attention variant an eager step can need has run
once (so a Triton compile never stalls a request): both query tilings and every split of
the KV range."""

from __future__ import annotations

import inspect
import types

from tiny_models import build_tiny_model

from inference import LLM


def test_warm_up_runs_each_prefill_variant(tmp_path):
    from kernels._triton import attention as triton_attention

    build_tiny_model(tmp_path, "llama")
    llm = LLM(str(tmp_path), max_model_len=256, max_num_batched_tokens=4096,
              num_kv_blocks=300, block_size=16)
    signature = inspect.signature(triton_attention.paged_attention)
    calls = []

    def record(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)  # the real kernel's signature accepts it
        calls.append((args[0].shape[0], bound.arguments["num_segments"]))
        return args[0]

    stand_in = types.SimpleNamespace(
        paged_attention=record,
        _MAX_SEGMENTS=triton_attention._MAX_SEGMENTS,
        _num_segments=triton_attention._num_segments,
    )
    llm.engine.runner._warm_up_attention_variants(stand_in)
    short = sorted(s for t, s in calls if t == 64)
    assert short == [1, 2, 4, 8, 16, 32, 64]
    long = [s for t, s in calls if t == 4096]
    assert long and long[0] == 1  # 128-row tiles: few splits, since 4096 tokens fill the GPU


def test_warm_up_runs_the_real_kernel(tmp_path):
    """The same warm-up through the Triton kernel itself (its interpreter on CPU)."""
    from kernels._triton import attention as triton_attention

    build_tiny_model(tmp_path, "llama")
    llm = LLM(str(tmp_path), max_model_len=256, num_kv_blocks=64, block_size=16)
    llm.engine.runner._warm_up_attention_variants(triton_attention)
