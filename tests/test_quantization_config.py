"""The ``quantization`` setting: one declaration, flags on every command line, and the
checkpoint's ``quantization_config`` resolved (or refused, naming what is supported)."""

from __future__ import annotations

import argparse

import pytest

from inference.cli import build_parser
from inference.config import EngineConfig
from inference.models.config import ModelConfig
from inference.quantization import Fp8Checkpoint, Int4Checkpoint, checkpoint_scheme
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
        add_serve_args(argparse.ArgumentParser()).parse_args(["m", "--quantization", "int4"])
    args = add_serve_args(argparse.ArgumentParser()).parse_args(["m", "--quantization", "awq"])
    assert engine_config(args, served_names(args)).quantization == "awq"


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


def w4a16(**weights) -> dict:
    """A compressed-tensors W4A16 release (llm-compressor's W4A16 scheme)."""
    config = compressed_tensors(inputs={}, format="pack-quantized")
    group = config["config_groups"]["group_0"]
    group["input_activations"] = None
    group["weights"] |= {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                         "actorder": None} | weights  # fmt: skip
    return config


# As published: AutoAWQ GEMM (e.g. Qwen2.5-7B-Instruct-AWQ) and AutoGPTQ releases.
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
       "version": "gemm", "modules_to_not_convert": None}  # fmt: skip
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
        "damp_percent": 0.01, "true_sequential": True, "static_groups": False}  # fmt: skip


def test_int4_layouts() -> None:
    assert checkpoint_scheme(AWQ) == Int4Checkpoint("awq", 128, symmetric=False)
    assert checkpoint_scheme(GPTQ) == Int4Checkpoint("gptq", 128, True, False, zero_offset=1)
    v2 = GPTQ | {"checkpoint_format": "gptq_v2", "desc_act": True, "sym": False, "group_size": -1}
    assert checkpoint_scheme(v2) == Int4Checkpoint("gptq", -1, False, True, zero_offset=0)
    assert checkpoint_scheme(w4a16()) == Int4Checkpoint("compressed-tensors", 128, True)
    channel = w4a16(strategy="channel", group_size=None, symmetric=False, actorder="group")
    assert checkpoint_scheme(channel) == Int4Checkpoint("compressed-tensors", -1, False, True)
    for config, method in ((AWQ, "awq"), (GPTQ, "gptq"), (w4a16(), "compressed-tensors")):
        assert EngineConfig("m").resolve(model(config), "cpu").quantization == method
        forced = EngineConfig("m", quantization=method).resolve(model(config), "cpu")
        assert forced.quantization == method
        with pytest.raises(ValueError, match=f"checkpoint is {method} 4-bit"):
            EngineConfig("m", quantization="fp8").resolve(model(config), "cpu")
    with pytest.raises(ValueError, match="only to fp8"):
        EngineConfig("m", quantization="gptq").resolve(model(), "cpu")


@pytest.mark.parametrize(("config", "named"), [
    (AWQ | {"bits": 8}, "AWQ with 8 bits"),
    (AWQ | {"version": "exllama"}, "AWQ version 'exllama'"),
    (AWQ | {"modules_to_not_convert": ["mlp"]}, "modules_to_not_convert"),
    (GPTQ | {"bits": 3}, "GPTQ with 3 bits"),
    (GPTQ | {"bits": 8}, "GPTQ with 8 bits"),
    (GPTQ | {"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    (GPTQ | {"group_size": 100}, "group_size 100"),
    (w4a16(num_bits=8), "weights of type 'int' with 8 bits"),
    (w4a16(strategy="tensor"), "strategy 'tensor'"),
    (w4a16() | {"format": "marlin-24"}, "format 'marlin-24'"),
])  # fmt: skip
def test_unsupported_int4_checkpoints_name_what_is_supported(config, named) -> None:
    with pytest.raises(ValueError, match='supported: .*quant_method "awq"') as error:
        EngineConfig("m").resolve(model(config), "cpu")
    assert named in str(error.value)


def test_tp_size_that_splits_a_group_is_refused_at_configuration() -> None:
    # o_proj: 4 heads x 16 = 64 inputs; down_proj: 128. Groups of 64: TP=2 splits o_proj's.
    config = model(GPTQ | {"group_size": 64})
    assert EngineConfig("m").resolve(config, "cpu").quantization == "gptq"
    with pytest.raises(ValueError, match="o_proj: tensor parallelism gives each rank 32"):
        EngineConfig("m", tensor_parallel_size=2).resolve(config, "cpu")
    # Act order keeps every group's scales on every rank: any TP size that splits K.
    EngineConfig("m", tensor_parallel_size=2).resolve(model(GPTQ | {"group_size": 64,
                                                                    "desc_act": True}), "cpu")


@pytest.mark.parametrize(("name", "method"), [
    ("qwen2.5-7b-awq", "awq"), ("llama-3-8b-gptq", "gptq"), ("qwen2.5-1.5b-w4a16", "compressed-tensors"),
])  # fmt: skip
def test_named_4bit_shapes_for_benchmarks(name: str, method: str) -> None:
    """``pagoda bench latency --model qwen2.5-7b-awq``: the real shape, a published 4-bit
    release's config, random weights; every layer's projections are int4 (built on the
    meta device here: no memory)."""
    import json
    from pathlib import Path

    import torch

    from inference.model_shapes import resolve_shape_model
    from inference.models.llama import DecoderLayer
    from inference.quantization.int4 import Int4Weights

    folder, extra = resolve_shape_model(name)
    config = ModelConfig.from_dict(json.loads((Path(folder) / "config.json").read_text()))
    assert extra == {"load_format": "dummy"}
    assert EngineConfig("m").resolve(config, "cuda").quantization == method
    with torch.device("meta"):
        layer = DecoderLayer(config, quantization=method)
    assert isinstance(layer.down_proj, Int4Weights)
    assert layer.down_proj.qweight.shape == (config.hidden_size, config.intermediate_size // 8)
    assert layer.down_proj.scales.shape == (config.hidden_size, config.intermediate_size // 128)
