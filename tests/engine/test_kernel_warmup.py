"""Before the engine reports ready, every attention variant a step can need has run once
(so a Triton compile never stalls a request): both query tilings, the decode tiling, and
every split of the KV range. The list comes from the kernel module (``tilings``), and it
must cover whatever ``choose_tiling`` picks for any step the scheduler can build."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import build_tiny_model

from inference import LLM


class _Device:
    """A stand-in CUDA device of ``sms`` multiprocessors for the tiling rules."""

    type = "cuda"

    def __init__(self, sms: int) -> None:
        self.sms = sms


@pytest.mark.parametrize("sms", [4, 132])
def test_tilings_cover_every_choice(monkeypatch, sms):
    from pagoda_kernels._triton import attention

    monkeypatch.setattr(attention, "num_sms", lambda device: device.sms)
    device = _Device(sms)
    rng = random.Random(sms)
    for _ in range(3000):
        head_size = rng.choice([64, 80, 128, 256])
        num_kv_heads = rng.choice([1, 2, 4, 8])
        num_heads = num_kv_heads * rng.choice([1, 2, 3, 4, 6, 8])
        budget = rng.choice([32, 256, 2048, 4096, 16384])
        num_seqs = rng.randint(1, 64)
        decode = rng.random() < 0.3
        if decode:
            num_tokens, max_query_len = num_seqs, 1
        else:
            num_tokens = rng.randint(num_seqs + 1, max(num_seqs + 1, budget))
            max_query_len = rng.randint(2, num_tokens - num_seqs + 1)
        chosen = attention.choose_tiling(num_tokens, num_seqs, num_heads, num_kv_heads,
                                         head_size, max_query_len, device)
        warmed = attention.tilings(num_heads, num_kv_heads, head_size, budget, device, decode)
        assert chosen in warmed, (num_tokens, num_seqs, num_heads, num_kv_heads, head_size,
                                  budget, chosen)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_engine_warm_up_runs_the_real_kernel(tmp_path, monkeypatch, kv_cache_dtype):
    """The engine's warm-up launches every listed variant through the Triton kernel itself
    (its interpreter on CPU); an FP8 cache's variants with the model's query dtype."""
    from pagoda_kernels._triton import attention

    build_tiny_model(tmp_path, "llama")
    llm = LLM(str(tmp_path), max_model_len=256, max_num_batched_tokens=4096,
              num_kv_blocks=300, block_size=16, kv_cache_dtype=kv_cache_dtype)
    runner = llm.engine.runner
    launched = []
    real_launch = attention._launch

    def record(*args):
        assert args[0].dtype == runner.dtype  # the queries: never the cache's FP8
        launched.append(args[-1])
        return real_launch(*args)

    monkeypatch.setattr(attention, "_launch", record)
    monkeypatch.setenv("PAGODA_DISABLE_TRITON", "0")  # TRITON_INTERPRET=1 on CPU runs
    tokens = runner.config.max_num_batched_tokens
    runner._warm_up_attention_variants(tokens)
    layer = runner.model.layers[0]
    k_cache = runner.kv_caches[0][0]
    expected = [
        tiling
        for decode in (False, True)
        for tiling in attention.tilings(layer.num_heads, k_cache.shape[2], k_cache.shape[3],
                                        tokens, torch.device("cpu"), decode)
    ]  # fmt: skip
    assert launched == expected
    assert {t.block_m for t in launched if t.block_q > 1} == {64, 128}  # both query tilings
    assert any(t.block_q == 1 for t in launched)
    assert len({t.num_segments for t in launched}) > 1  # the KV splits too
