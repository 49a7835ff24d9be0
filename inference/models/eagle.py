"""An EAGLE draft head (EAGLE-1/2, Li et al. 2024) for a Llama-family target, in the
layout the EAGLE authors publish (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B) and vLLM loads.

The head predicts the target's next feature rather than its next token: at position p it
reads the embedding of token p + 1 beside the target's feature at p (the final hidden
state, after the final norm: what the target's LM head reads), fuses them with ``fc``
(2H -> H), runs its decoder layer(s) and hands the result straight to the target's LM
head (no norm: the head was trained to produce what the LM head reads). Drafting further
feeds the head its own output as the next feature.

Checkpoint: ``config.json`` (a Llama config, ``num_hidden_layers`` usually 1) and weights
(``*.safetensors`` or ``pytorch_model.bin``) named ``fc.weight`` (H x 2H), optionally
``fc.bias``, and ``layers.N.*`` as a Llama decoder layer's, where layer 0 has no
``input_layernorm`` (its input is ``fc``'s output as is; a checkpoint that has one anyway
is read as vLLM does, without it). ``embed_tokens.weight``, where present, is the target's
table copied: the target's is used (as vLLM does), after checking its shape. The LM head
is the target's. Anything else (an own ``lm_head``, ``d2t``/``t2d`` vocabulary maps, a
``midlayer``: EAGLE-3, which ``inference.models.eagle3`` loads; HASS or speculators names)
is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from inference.layers.attention_metadata import AttentionMetadata
from inference.layers.rotary import build_cos_sin_cache
from inference.models.config import ModelConfig
from inference.models.llama import DecoderLayer, _empty, _linear
from inference.models.loader import _default_dtype, iter_safetensors

# What config.json may name as the head's architecture.
EAGLE_ARCHITECTURES = ("LlamaForCausalLM", "EagleLlamaForCausalLM")
SUPPORTED_LAYOUT = (
    "an EAGLE-1/2 head for a Llama-family target: config.json plus weights fc.weight "
    "(hidden x 2*hidden), optional fc.bias, layers.N.* (Llama decoder layers, layer 0 "
    "without input_layernorm), optional embed_tokens.weight; the LM head is the target's"
)
_EAGLE3_MARKS = ("d2t", "t2d", "lm_head.weight", "midlayer.", "norm.weight")


def eagle_head_config(folder: Path, target: ModelConfig) -> ModelConfig:
    """The head's shape from its ``config.json``; ValueError where it cannot draft for
    ``target`` (another width or vocabulary) or is another layout (EAGLE-3)."""
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no config.json; expected {SUPPORTED_LAYOUT}")
    raw = json.loads(path.read_text())
    if "draft_vocab_size" in raw or raw.get("speculators_model_type"):
        raise ValueError(f"{folder} is not an EAGLE-1/2 head (an EAGLE-3 or speculators "
                         f"config: EAGLE-3 heads load with method 'eagle3'); supported "
                         f"here: {SUPPORTED_LAYOUT}")
    archs = raw.get("architectures") or []
    if not any(a in EAGLE_ARCHITECTURES for a in archs):
        raise ValueError(f"EAGLE head architecture {archs or '(none given)'} is not "
                         f"supported; supported: {list(EAGLE_ARCHITECTURES)}")
    config = ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"]})
    if config.hidden_size != target.hidden_size:
        raise ValueError(f"EAGLE head hidden_size {config.hidden_size} differs from the "
                         f"target's {target.hidden_size}")
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"EAGLE head vocab_size {config.vocab_size} differs from the "
                         f"target's {target.vocab_size}")
    return config


class EagleHead(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int, fc_bias: bool) -> None:
        super().__init__()
        self.config = cfg
        hidden = cfg.hidden_size
        self.fc = _empty(hidden, 2 * hidden)
        self.fc_bias = _empty(hidden) if fc_bias else None
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, input_norm=i > 0) for i in range(cfg.num_layers)
        )
        self.register_buffer(
            "cos_sin_cache",
            build_cos_sin_cache(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling),
            persistent=False,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        features: torch.Tensor,
        embed_tokens: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The head's outputs [T, hidden] (what the target's LM head reads): token
        ``input_ids[t]`` is the one after the position whose feature is ``features[t]``."""
        embedded = nn.functional.embedding(input_ids, embed_tokens)
        hidden = _linear(torch.cat([embedded, features.to(embedded.dtype)], dim=-1), self.fc,
                         self.fc_bias)  # fmt: skip
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, self.cos_sin_cache,
                                     meta)  # fmt: skip
        return hidden + residual


def load_eagle_head(
    folder: Path, cfg: ModelConfig, target_embed: torch.Tensor, dtype: torch.dtype,
    device: torch.device, max_position: int,
) -> EagleHead:
    """The head of ``folder`` on ``device``; ValueError, naming the supported layout, for
    weights it does not have or does not know."""
    weights = dict(read_head_weights(folder, device))
    mapped = {}
    for name, weight in weights.items():
        target = _map_weight(name.removeprefix("model."), cfg)
        if target is not None:
            mapped.setdefault(target[0], []).append((target[1], weight, name))
    if "fc" not in mapped:
        raise ValueError(f"{folder}: no fc.weight; expected {SUPPORTED_LAYOUT}")
    embed = weights.get("embed_tokens.weight", weights.get("model.embed_tokens.weight"))
    if embed is not None and tuple(embed.shape) != tuple(target_embed.shape):
        raise ValueError(f"{folder}: embed_tokens.weight of shape {tuple(embed.shape)}, the "
                         f"target's {tuple(target_embed.shape)}")
    with _default_dtype(dtype), torch.device(device):
        head = EagleHead(cfg, max_position, fc_bias="fc_bias" in mapped)
    head.cos_sin_cache = head.cos_sin_cache.to(device=device, dtype=torch.float32)
    expected = {name for name, _ in head.named_parameters()}
    with torch.no_grad():
        for param_name, parts in mapped.items():
            if param_name not in expected:
                raise ValueError(f"{folder}: unexpected weights {[p[2] for p in parts]}; "
                                 f"expected {SUPPORTED_LAYOUT}")
            param = head.get_parameter(param_name)
            for rows, weight, name in parts:
                dest = param.data if rows is None else param.data.narrow(0, *rows)
                if tuple(dest.shape) != tuple(weight.shape):
                    raise ValueError(f"{folder}: weight {name} has shape "
                                     f"{tuple(weight.shape)}, expected {tuple(dest.shape)}")
                dest.copy_(weight)
    missing = expected - set(mapped)
    if missing or any(len(parts) != _num_parts(name) for name, parts in mapped.items()):
        raise ValueError(f"{folder}: missing weights {sorted(missing) or '(parts of fused ones)'}"
                         f"; expected {SUPPORTED_LAYOUT}")
    return head.eval()


def read_head_weights(folder: Path, device: torch.device):
    """(name, tensor) of the head's safetensors files, or of its ``pytorch_model.bin`` (as
    the EAGLE authors publish theirs), read without running pickled code."""
    if any(folder.glob("*.safetensors")):
        for name, weight in iter_safetensors(folder, device):
            yield name, weight.read()
        return
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise ValueError(f"{folder} holds no *.safetensors or pytorch_model.bin weights")
    for path in bins:
        yield from torch.load(path, map_location=device, weights_only=True).items()


def _num_parts(param_name: str) -> int:
    if param_name.endswith(("qkv_proj", "qkv_bias")):
        return 3
    return 2 if param_name.endswith("gate_up_proj") else 1


def _map_weight(name: str, cfg: ModelConfig) -> tuple[str, tuple[int, int] | None] | None:
    """(parameter, its rows or None for all) of a checkpoint weight; None for one the head
    does not read (the target's embedding copied, the first layer's input norm)."""
    if name == "fc.weight":
        return "fc", None
    if name == "fc.bias":
        return "fc_bias", None
    if name == "embed_tokens.weight" or "rotary_emb" in name:
        return None
    if name in _EAGLE3_MARKS or name.startswith("midlayer."):
        raise ValueError(f"EAGLE head weight {name!r} belongs to another layout (EAGLE-3: "
                         f"load it with method 'eagle3'); supported here: {SUPPORTED_LAYOUT}")
    parts = name.split(".")
    if len(parts) < 4 or parts[0] != "layers" or not parts[1].isdigit():
        raise ValueError(f"unexpected EAGLE head weight {name!r}; expected {SUPPORTED_LAYOUT}")
    prefix, module, leaf = f"layers.{parts[1]}.", parts[2], ".".join(parts[3:])
    if module == "input_layernorm" and leaf == "weight":
        return None if parts[1] == "0" else (prefix + "input_norm", None)
    if module == "post_attention_layernorm" and leaf == "weight":
        return prefix + "post_attention_norm", None
    dim = cfg.head_dim
    q, kv = cfg.num_heads * dim, cfg.num_kv_heads * dim
    spans = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv),
             "gate_proj": (0, cfg.intermediate_size),
             "up_proj": (cfg.intermediate_size, cfg.intermediate_size)}  # fmt: skip
    proj, kind = parts[3], parts[-1]
    if module == "self_attn" and proj in ("q_proj", "k_proj", "v_proj") and len(parts) == 5:
        return prefix + ("qkv_proj" if kind == "weight" else "qkv_bias"), spans[proj]
    if module == "self_attn" and leaf == "o_proj.weight":
        return prefix + "o_proj", None
    if module == "mlp" and proj in ("gate_proj", "up_proj") and kind == "weight":
        return prefix + "gate_up_proj", spans[proj]
    if module == "mlp" and leaf == "down_proj.weight":
        return prefix + "down_proj", None
    raise ValueError(f"unexpected EAGLE head weight {name!r}; expected {SUPPORTED_LAYOUT}")
