"""The model's shape, read straight from a Hugging Face ``config.json``.

Reading the JSON ourselves (rather than through transformers' config classes) keeps the
engine independent of how a transformers release names things; both the v4 layout
(``rope_theta`` + ``rope_scaling``) and the v5 layout (``rope_parameters``) are accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Families that share the Llama block and differ only in these switches.
_ARCH_FLAGS: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
}
SUPPORTED_ARCHITECTURES = tuple(_ARCH_FLAGS)


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None
    torch_dtype: str | None
    eos_token_ids: list[int]
    bos_token_id: int | None
    # The checkpoint's Hugging Face quantization_config, as written (inference.quantization
    # reads it); None for an unquantized checkpoint.
    quantization_config: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in _ARCH_FLAGS), None)
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {archs or '(none given)'}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        flags = _ARCH_FLAGS[arch]
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rope_theta, rope_scaling = _rope_settings(cfg)
        sliding_window = cfg.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
            sliding_window = None
        if arch in ("LlamaForCausalLM", "MistralForCausalLM") and cfg.get("attention_bias"):
            flags = {**flags, "qkv_bias": True}
        if cfg.get("mlp_bias"):
            raise ValueError("models with mlp_bias=true are not supported")
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=flags["qkv_bias"],
            qk_norm=flags["qk_norm"],
            sliding_window=sliding_window,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            quantization_config=cfg.get("quantization_config"),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ValueError(f"{folder} has no config.json; expected a Hugging Face model folder")
        return cls.from_dict(json.loads(path.read_text()))


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = cfg.get("rope_parameters")
    if params:  # transformers v5 layout
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = dict(cfg["rope_scaling"]) if cfg.get("rope_scaling") else {}
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling
