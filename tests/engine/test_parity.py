"""Greedy tokens equal transformers' generate for every supported architecture, under
every scheduling regime the engine has: block sizes, preemption, chunked prefill and
prefix caching."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model, hf_greedy

from inference import LLM, SamplingParams

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = build_tiny_model(folder, request.param)
    gen = torch.Generator().manual_seed(7)
    lengths = [5, 17, 33, 2, 60, 9, 24, 40]
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in lengths]
    return folder, prompts, hf_greedy(model, prompts, NEW_TOKENS)


def run(folder, prompts, **engine_args):
    llm = LLM(str(folder), max_model_len=256, **engine_args)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.engine


@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_matches_transformers(tiny, block_size):
    folder, prompts, expected = tiny
    got, engine = run(folder, prompts, block_size=block_size)
    assert got == expected
    assert engine.block_manager.num_free_blocks == engine.num_total_blocks


def test_preemption_keeps_outputs(tiny):
    folder, prompts, expected = tiny
    # 256 tokens of KV for 8 requests that need up to 92 each: preemption is certain.
    got, engine = run(folder, prompts, block_size=4, num_kv_blocks=64)
    assert got == expected
    assert engine.stats().num_preemptions_total > 0


def test_chunked_prefill(tiny):
    folder, prompts, expected = tiny
    got, engine = run(folder, prompts, block_size=16, max_num_batched_tokens=8)
    assert got == expected


def test_prefix_caching_skips_shared_prefix(tiny):
    folder, prompts, _ = tiny
    shared = prompts[4][:48]  # three full blocks of 16
    suffixed = [shared + p[:7] for p in prompts[:4]]
    llm = LLM(str(folder), max_model_len=256, block_size=16, enable_prefix_caching=True)
    first = llm.generate(suffixed[:1], GREEDY, use_tqdm=False)
    engine = llm.engine
    before = engine.computed_tokens_total
    rest = llm.generate(suffixed[1:], GREEDY, use_tqdm=False)
    computed = engine.computed_tokens_total - before
    # Without the cache the prompts alone would cost sum(len) tokens; 48 of each are hits.
    prompt_tokens = sum(len(p) for p in suffixed[1:])
    decode_tokens = 3 * (NEW_TOKENS - 1)
    assert computed == prompt_tokens - 3 * 48 + decode_tokens
    assert all(o.num_cached_tokens == 48 for o in rest)
    stats = engine.stats()
    assert stats.prefix_cache_hits_total == 3 * 48
    # And the cache changes nothing in the result.
    no_cache = LLM(str(folder), max_model_len=256, block_size=16, enable_prefix_caching=False)
    expected = no_cache.generate(suffixed, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == [
        o.outputs[0].token_ids for o in expected
    ]


def test_llama3_rope_scaling_and_tied_embeddings(tmp_path):
    """Llama 3.x frequency scaling, with prompts past the original context, and tied
    input/output embeddings."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
            "rope_theta": 500000.0}
    model = build_tiny_model(tmp_path, "llama", tie_word_embeddings=True, rope_parameters=rope)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 70, 130)]
    got, _ = run(tmp_path, prompts)
    assert got == hf_greedy(model, prompts, NEW_TOKENS)


def test_config_v4_and_v5_rope_layouts_agree():
    from inference.models.config import ModelConfig

    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    v4 = ModelConfig.from_dict({**base, "rope_theta": 5e5,
                                "rope_scaling": {"rope_type": "llama3", **scaling}})
    v5 = ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "llama3",
                                                            "rope_theta": 5e5, **scaling}})
    assert (v4.rope_theta, v4.rope_scaling) == (v5.rope_theta, v5.rope_scaling)
    plain = ModelConfig.from_dict({**base, "rope_scaling": {"type": "default"}})
    assert plain.rope_scaling is None and plain.rope_theta == 10000.0
