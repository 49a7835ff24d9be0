"""FP8 weights under tensor parallelism (CPU, gloo): each rank's shard of the weights and
of their scales is right.

Two ranks do not compute what one does, by design (as in vLLM): the row-parallel o_proj
and down_proj quantize each rank's share of the input per token on its own, and weights
quantized at load (online, or requantized from blocks) get per-rank scales there. So each
TP size is checked against transformers running exactly its scheme
(``fp8_checkpoints.fake_quantized_reference(world=...)``), and TP=2 against TP=1 within
the quantization's own noise."""

from __future__ import annotations

import pytest
from fp8_checkpoints import (
    check,
    differences,
    engine_prompt_logprobs,
    held_weights,
    original_projections,
    reference_prompt_logprobs,
    write_fp8_checkpoint,
)
from tiny_models import build_tiny_model

# (arch, overrides, layout): KV heads split (Qwen2, qkv bias) with blocks that straddle
# the ranks' column shards; one KV head replicated on both ranks with q/k norm, tied
# embeddings and an odd vocabulary, quantized online; Llama from per-channel scales.
CASES = {
    "qwen2-block": ("qwen2", {}, "hf-block"),
    "qwen3-1kv-online": (
        "qwen3", {"num_key_value_heads": 1, "tie_word_embeddings": True, "vocab_size": 321},
        "online",
    ),
    "llama-channel": ("llama", {}, "ct-channel"),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    arch, overrides, layout = CASES[request.param]
    source = tmp_path_factory.mktemp(request.param)
    build_tiny_model(source, arch, qk_scale=2.0, **overrides)
    if layout == "online":
        folder, meant, kwargs = source, original_projections(source), {"quantization": "fp8"}
    else:
        folder = tmp_path_factory.mktemp(request.param + "-fp8") / "model"
        meant, kwargs = write_fp8_checkpoint(source, folder, layout, block=(32, 48)), {}
    engine = {tp: engine_prompt_logprobs(folder, tensor_parallel_size=tp, **kwargs)
              for tp in (1, 2)}  # fmt: skip
    requantize = layout in ("online", "hf-block")
    reference = {
        tp: reference_prompt_logprobs(source, held_weights(meant, tp, requantize), world=tp)
        for tp in (1, 2)
    }
    return engine, reference


def test_each_tp_size_runs_its_scheme_exactly(case) -> None:
    engine, reference = case
    for tp in (1, 2):
        check(engine[tp], reference[tp])


def test_two_ranks_agree_with_one_within_quantization_noise(case) -> None:
    engine, reference = case
    between_schemes = differences(reference[2], reference[1])[0]
    assert differences(engine[2], engine[1])[0] <= between_schemes + 1e-2
