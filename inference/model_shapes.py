"""Named real-model shapes (``qwen2.5-0.5b``, ``qwen2.5-1.5b``, ``qwen2.5-7b``, ``llama-3-8b``) served or
benchmarked with random weights: the name resolves to a folder holding the exact
config.json (and, for the server, a word-level tokenizer of the exact vocabulary).
A 4-bit suffix (``qwen2.5-7b-awq``, ``-gptq``, ``-w4a16``) adds the quantization_config of
a published 4-bit release (groups of 128), so that the int4 kernels run at real shapes."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

# Exact shapes of real models; their weights are random (speed does not depend on values).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-1.5b": {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 1536,
        "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
        "num_key_value_heads": 2, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "eos_token_id": 151643,
    },
    "qwen2.5-0.5b": {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "eos_token_id": 151643,
    },
    "qwen2.5-7b": {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "eos_token_id": 151643,
    },
    "llama-3-8b": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 8192, "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "eos_token_id": 128001,
    },
}


# quantization_config of the 4-bit releases, by shape-name suffix (as AutoAWQ, AutoGPTQ
# and llm-compressor's W4A16 scheme write them).
INT4_SHAPE_SUFFIXES: dict[str, dict[str, Any]] = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
            "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True,
             "desc_act": False},
    "w4a16": {"quant_method": "compressed-tensors", "format": "pack-quantized",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                  "group_size": 128}}}},
}  # fmt: skip


def shape_config(model: str) -> dict[str, Any] | None:
    """The config.json of a named shape (with a 4-bit suffix's quantization_config), or
    None for anything else."""
    if model in SHAPES:
        return SHAPES[model]
    base, _, suffix = model.rpartition("-")
    if base in SHAPES and suffix in INT4_SHAPE_SUFFIXES:
        return SHAPES[base] | {"quantization_config": INT4_SHAPE_SUFFIXES[suffix]}
    return None


def resolve_shape_model(model: str, with_tokenizer: bool = False) -> tuple[str, dict[str, Any]]:
    """A named shape becomes a folder holding its config.json (and, for the server, a
    synthetic tokenizer in ``tokenizer/``), loaded with random weights; anything else is a model folder
    loaded as usual."""
    shape = shape_config(model)
    if shape is not None:
        folder = Path(tempfile.mkdtemp(prefix=f"pagoda-{model}-"))
        (folder / "config.json").write_text(json.dumps(shape))
        if with_tokenizer:
            # Its own folder: beside config.json, AutoTokenizer would pick the model
            # family's tokenizer class instead of this one.
            write_synthetic_tokenizer(folder / "tokenizer", shape["vocab_size"],
                                      shape["eos_token_id"])
        return str(folder), {"load_format": "dummy"}
    return model, {}


def write_synthetic_tokenizer(folder: Path, vocab_size: int, eos_token_id: int) -> None:
    """A word-level tokenizer with exactly ``vocab_size`` entries ("w0", "w1", ...), so a
    random-weight model can be served end to end (text in, text out) without the real
    model's tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"\u2581w{i}": i for i in range(vocab_size)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="\u2581w0"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    core.decoder = decoders.Metaspace(prepend_scheme="always")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="\u2581w0", eos_token=f"\u2581w{eos_token_id}"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant {% endif %}"
    )
    tokenizer.save_pretrained(folder)
