"""FP8 weights end to end on CPU: online quantization and the published FP8 checkpoint
layouts load into the engine, whose prompt logprobs (teacher-forced) match transformers'
float32 forward of the same quantized model with per-token FP8 activations
(``tests/fp8_checkpoints.py``); and what is not supported is refused at load."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from fp8_checkpoints import (
    ENGINE,
    PROMPTS,
    check,
    differences,
    engine_prompt_logprobs,
    held_weights,
    original_projections,
    reference_prompt_logprobs,
    write_fp8_checkpoint,
)
from safetensors.torch import load_file
from tiny_models import build_tiny_model

from inference import LLM, SamplingParams


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen2")
    build_tiny_model(folder, "qwen2", qk_scale=2.0)  # qkv bias; sharp attention
    return folder


def test_online_quantization_matches_the_scheme(source: Path) -> None:
    reference = reference_prompt_logprobs(source, held_weights(original_projections(source)))
    mean = check(engine_prompt_logprobs(source, quantization="fp8"), reference)
    # ...and the quantization is visible: the unquantized model is much further away.
    assert differences(engine_prompt_logprobs(source), reference)[0] > 5 * mean


@pytest.mark.parametrize("layout", ["ct-channel", "ct-tensor"])
def test_compressed_tensors_checkpoints_load_as_stored(source, tmp_path, layout) -> None:
    folder = tmp_path / layout
    meant = write_fp8_checkpoint(source, folder, layout)
    # The scheme is detected from the checkpoint's config.
    check(engine_prompt_logprobs(folder), reference_prompt_logprobs(source, meant))


def test_block_wise_checkpoint_is_requantized_per_channel(source, tmp_path) -> None:
    """Blocks of [32, 48] (partial blocks at the edges): the engine holds each row
    requantized with its own scale, which costs one more e4m3 rounding of the weights
    (bounded here; on this model about as large as the checkpoint's own error). The
    logprobs match the scheme run on exactly those weights."""
    folder = tmp_path / "hf-block"
    meant = write_fp8_checkpoint(source, folder, "hf-block", block=(32, 48))
    with LLM(str(folder), **ENGINE) as llm:
        assert llm.engine.config.quantization == "fp8"
        layer = llm.engine.runner.model.layers[0]
        held = layer.gate_up_proj.float() * layer.gate_up_proj_scale[:, None]
    prefix = "model.layers.0.mlp."
    block_meant = torch.cat([meant[prefix + "gate_proj.weight"], meant[prefix + "up_proj.weight"]])
    original = torch.cat([original_projections(source)[prefix + p + ".weight"]
                          for p in ("gate_proj", "up_proj")])  # fmt: skip
    requantized = (held - block_meant).norm() / block_meant.norm()
    checkpoint_error = (block_meant - original).norm() / original.norm()
    # One more e4m3 rounding: at most half an fp8 step (2^-4 relative) per weight.
    assert 0 < requantized.item() < 2**-4
    assert (held - original).norm() / original.norm() < 2 * checkpoint_error
    print(f"block-wise [32, 48] requantized per channel: weight error {requantized:.4f} "
          f"relative to the checkpoint's; checkpoint vs original {checkpoint_error:.4f}")
    check(engine_prompt_logprobs(folder), reference_prompt_logprobs(source, held_weights(meant)))


def test_greedy_decoding_runs_on_an_fp8_checkpoint(source, tmp_path) -> None:
    folder = tmp_path / "ct"
    write_fp8_checkpoint(source, folder, "ct-channel")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    with LLM(str(folder), **ENGINE) as llm:
        [out] = llm.generate([PROMPTS[0]], greedy, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert len(tokens) == 12
    assert all(math.isfinite(lp[t].logprob) for lp, t in zip(out.outputs[0].logprobs, tokens,
                                                              strict=True))  # fmt: skip


def test_unsupported_checkpoints_fail_at_load(source, tmp_path) -> None:
    bnb = tmp_path / "bitsandbytes"
    write_fp8_checkpoint(source, bnb, "ct-channel")
    config = json.loads((bnb / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (bnb / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'bitsandbytes'.*supported: quant_method \"fp8\""):
        LLM(str(bnb), **ENGINE)
    # A checkpoint whose tensors carry static activation scales its config does not declare.
    static = tmp_path / "static"
    write_fp8_checkpoint(source, static, "ct-channel")
    from safetensors.torch import save_file

    (file,) = static.glob("*.safetensors")
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.o_proj.input_scale"] = torch.ones(1)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="static activation or KV-cache scales"):
        LLM(str(static), **ENGINE)


def test_fp8_checkpoint_with_kv_cache_scales_loads_them(source, tmp_path) -> None:
    """An FP8 checkpoint that also carries KV-cache scales (vLLM's names) loads, and an FP8
    KV cache uses them; the static activation scale beside them is still refused."""
    folder = tmp_path / "kv-scales"
    write_fp8_checkpoint(source, folder, "hf-block")
    from safetensors.torch import save_file

    (file,) = folder.glob("*.safetensors")
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.05)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.01)
    tensors["model.layers.1.self_attn.k_proj.output_scale"] = torch.tensor(0.03)
    save_file(tensors, str(file), metadata={"format": "pt"})
    llm = LLM(str(folder), **ENGINE, kv_cache_dtype="fp8")
    layers = llm.engine.runner.model.layers
    assert layers[0].k_scale.item() == pytest.approx(0.05)
    assert layers[0].v_scale.item() == pytest.approx(0.01)
    assert layers[1].k_scale.item() == pytest.approx(0.03)
    [out] = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4,
                                                       ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    llm.shutdown()
    tensors["model.layers.0.self_attn.o_proj.input_scale"] = torch.ones(1)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="static activation or KV-cache scales"):
        LLM(str(folder), **ENGINE, kv_cache_dtype="fp8")
