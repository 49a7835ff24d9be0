"""EngineConfig: resolution into a new frozen config, the batch-limit rule, and the
command lines generated from its fields (serve, bench and chat keep their flag names)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from inference.cli import build_parser
from inference.config import EngineConfig, ResolvedEngineConfig, engine_kwargs
from inference.models.config import ModelConfig
from inference.server.cli_serve import add_serve_args, engine_config, served_names

MODEL = ModelConfig.from_dict({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 4096,
})  # fmt: skip


def test_resolve_returns_a_new_frozen_config_and_leaves_the_given_one_alone() -> None:
    given = EngineConfig("m")
    resolved = given.resolve(MODEL, "cuda")
    assert isinstance(resolved, ResolvedEngineConfig)
    assert (resolved.max_model_len, resolved.max_num_seqs, resolved.max_num_batched_tokens) == (
        4096, 1024, 16384,
    )
    assert (given.max_model_len, given.max_num_seqs, given.max_num_batched_tokens) == (
        None, None, None,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.max_num_seqs = 1  # type: ignore[misc]
    cpu = given.resolve(MODEL, "cpu")
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (256, 2048)


def test_max_model_len_beyond_the_model_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds the model's limit of 4096"):
        EngineConfig("m", max_model_len=8192).resolve(MODEL, "cpu")


def test_batched_tokens_below_max_num_seqs_is_refused_as_vllm_does() -> None:
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be >= max_num_seqs"):
        EngineConfig("m", max_num_seqs=16, max_num_batched_tokens=8)
    EngineConfig("m", max_num_seqs=8, max_num_batched_tokens=8)  # equal is fine


def test_a_limit_left_out_defers_to_the_one_given() -> None:
    # A small budget (chunked prefill tests use 8) lowers the default max_num_seqs to it...
    small = EngineConfig("m", max_num_batched_tokens=8).resolve(MODEL, "cpu")
    assert (small.max_num_seqs, small.max_num_batched_tokens) == (8, 8)
    # ...and many sequences raise the default budget to them.
    many = EngineConfig("m", max_num_seqs=4096).resolve(MODEL, "cpu")
    assert (many.max_num_seqs, many.max_num_batched_tokens) == (4096, 4096)


def test_flags_left_out_leave_the_default_to_engine_config() -> None:
    args = add_serve_args(argparse.ArgumentParser()).parse_args([])
    assert engine_kwargs(args) == {}
    assert engine_config(args, served_names(args)) == EngineConfig(
        "default", served_model_name="SmolLM2-135M-Instruct"
    )


def test_serve_flags_keep_their_names() -> None:
    parser = add_serve_args(argparse.ArgumentParser())
    args = parser.parse_args([
        "m", "-tp", "2", "--gpu-memory-utilization", "0.8", "--max-num-seqs", "64",
        "--max-num-batched-tokens", "512", "--block-size", "32", "--max-model-len", "1024",
        "--dtype", "bfloat16", "--device", "cuda", "--no-enable-prefix-caching",
        "--enforce-eager", "--seed", "3", "--num-kv-blocks", "100", "--tokenizer", "tok",
        "--load-format", "dummy", "--no-async-scheduling", "--served-model-name", "a", "b",
    ])  # fmt: skip
    config = engine_config(args, served_names(args))
    assert config == EngineConfig(
        "m", tokenizer="tok", served_model_name="a", tensor_parallel_size=2,
        gpu_memory_utilization=0.8, max_num_seqs=64, max_num_batched_tokens=512,
        block_size=32, max_model_len=1024, enable_prefix_caching=False, enforce_eager=True,
        dtype="bfloat16", seed=3, device="cuda", num_kv_blocks=100, load_format="dummy",
        async_scheduling=False,
    )  # fmt: skip


def test_bench_and_chat_share_the_engine_flags_with_their_own_defaults() -> None:
    from inference.bench.common import engine_kwargs as bench_engine_kwargs

    parser = build_parser()
    bench = parser.parse_args(["bench", "throughput", "--no-enable-prefix-caching",
                               "--no-async-scheduling", "--enforce-eager", "-tp", "2"])
    assert bench_engine_kwargs(bench, max_len_needed=640) == {
        "enable_prefix_caching": False, "async_scheduling": False, "enforce_eager": True,
        "tensor_parallel_size": 2, "max_model_len": 640,
    }  # fmt: skip
    chat = parser.parse_args(["chat", "hi", "--device", "cpu"])
    assert engine_kwargs(chat) == {"device": "cpu", "max_model_len": 2048}
