"""The ``quantization`` setting: one declaration, flags on every command line, and the
checkpoint's ``quantization_config`` resolved (or refused, naming what is supported)."""

from __future__ import annotations

import argparse

import pytest

from inference.cli import build_parser
from inference.config import EngineConfig
from inference.models.config import ModelConfig
from inference.quantization import Fp8Checkpoint, checkpoint_scheme
from inference.server.cli_serve import add_serve_args, engine_config, served_names

BASE = {
    "architectures": ["Qwen2ForCausalLM"], "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 4096,
}  # fmt: skip
# As published: Qwen3-8B-FP8 ...
HF_FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128]}  # fmt: skip


def compressed_tensors(strategy: str = "channel", inputs: dict | None = None, **extra) -> dict:
    """... and an "FP8-dynamic" release (llm-compressor's FP8_DYNAMIC scheme)."""
    weights = {"dynamic": False, "num_bits": 8, "observer": "minmax", "strategy": strategy,
               "symmetric": True, "type": "float"}  # fmt: skip
    if inputs is None:
        inputs = {"dynamic": True, "num_bits": 8, "strategy": "token", "symmetric": True,
                  "type": "float"}  # fmt: skip
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": inputs}},
    } | extra  # fmt: skip


def model(quantization_config: dict | None = None) -> ModelConfig:
    return ModelConfig.from_dict(BASE | {"quantization_config": quantization_config})


def test_the_flag_reaches_serve_and_bench() -> None:
    args = add_serve_args(argparse.ArgumentParser()).parse_args(["m", "--quantization", "fp8"])
    assert engine_config(args, served_names(args)).quantization == "fp8"
    parser = build_parser()
    for bench in ("throughput", "latency"):
        assert parser.parse_args(["bench", bench, "--quantization", "fp8"]).quantization == "fp8"
    with pytest.raises(SystemExit):  # argparse names the choices
        add_serve_args(argparse.ArgumentParser()).parse_args(["m", "--quantization", "awq"])


def test_resolve_takes_the_request_or_the_checkpoints_own() -> None:
    assert EngineConfig("m").resolve(model(), "cpu").quantization is None
    assert EngineConfig("m", quantization="fp8").resolve(model(), "cpu").quantization == "fp8"
    for config in (HF_FP8_BLOCK, compressed_tensors()):
        assert EngineConfig("m").resolve(model(config), "cpu").quantization == "fp8"
        assert EngineConfig("m", quantization="fp8").resolve(model(config), "cpu").quantization
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig("m", quantization="int4")


def test_published_layouts() -> None:
    assert checkpoint_scheme(None) is None
    assert checkpoint_scheme(HF_FP8_BLOCK) == Fp8Checkpoint("fp8", (128, 128))
    per_tensor = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    assert checkpoint_scheme(per_tensor) == Fp8Checkpoint("fp8", None)
    assert checkpoint_scheme(compressed_tensors()) == Fp8Checkpoint("compressed-tensors")
    assert checkpoint_scheme(compressed_tensors("tensor")).block_size is None
    weight_only = compressed_tensors(inputs={})  # W8A16: activations quantized at run time
    weight_only["config_groups"]["group_0"]["input_activations"] = None
    assert checkpoint_scheme(weight_only) == Fp8Checkpoint("compressed-tensors")


@pytest.mark.parametrize(("config", "named"), [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    (HF_FP8_BLOCK | {"activation_scheme": "static"}, "static activation scales"),
    (HF_FP8_BLOCK | {"fmt": "e5m2"}, "e5m2"),
    (HF_FP8_BLOCK | {"weight_block_size": [128]}, "block size"),
    (compressed_tensors(inputs={"dynamic": False, "num_bits": 8, "strategy": "tensor",
                                "type": "float"}), "static activation scales"),  # fmt: skip
    (compressed_tensors("group"), "weight strategy 'group'"),
    (compressed_tensors(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
])  # fmt: skip
def test_unsupported_checkpoints_are_refused_naming_what_is_supported(config, named) -> None:
    with pytest.raises(ValueError, match="supported: quant_method \"fp8\"") as error:
        EngineConfig("m").resolve(model(config), "cpu")
    assert named in str(error.value)


def test_int4_compressed_tensors_is_refused() -> None:
    config = compressed_tensors()
    config["config_groups"]["group_0"]["weights"] |= {"num_bits": 4, "type": "int"}
    with pytest.raises(ValueError, match="only float 8-bit"):
        checkpoint_scheme(config)
