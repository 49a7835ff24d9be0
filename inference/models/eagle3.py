"""An EAGLE-3 draft head (Li et al. 2025) for a Llama-family target, in the layout the
EAGLE authors publish (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B) and vLLM loads.

EAGLE-3 reads three of the target's layers instead of its last one: the residual stream
entering layers ``low, mid, high`` (by default 2, L // 2 and L - 3 of the target's L
layers; ``eagle_aux_hidden_state_layer_ids`` in the head's config, or in its
``eagle_config``, names others), concatenated per token (3H) and fused by ``fc`` (3H -> H).
Its one decoder layer (``midlayer``) attends over ``[input_layernorm(embedding of token
p + 1), hidden_norm(feature at p)]`` (2H wide into q/k/v), the feature itself being the
residual (``norm_before_residual``: its normed value), and ends in its own ``norm`` and
``lm_head`` over a reduced *draft vocabulary*: draft id ``i`` is target id ``i + d2t[i]``.
Drafting further feeds the layer's output before the final norm back as the next feature
(H wide: no ``fc``).

Checkpoint: ``config.json`` (a Llama config; ``draft_vocab_size``; architecture
``LlamaForCausalLMEagle3`` or ``Eagle3LlamaForCausalLM``) and weights (``*.safetensors``
or ``pytorch_model.bin``): ``fc.weight`` (H x 3H), ``midlayer.*`` (a Llama decoder layer's
names, ``q/k/v_proj`` 2H wide, plus ``hidden_norm.weight``), ``norm.weight``,
``lm_head.weight`` (draft vocabulary x H), ``d2t`` (int64, draft vocabulary) and optionally
``t2d`` (unused) and ``embed_tokens.weight`` (used where present, else the target's).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

import pagoda_kernels as kernels
from inference.layers.attention_metadata import AttentionMetadata
from inference.layers.rotary import build_cos_sin_cache
from inference.models.config import ModelConfig
from inference.models.eagle import read_head_weights
from inference.models.llama import DecoderLayer, _empty, _linear
from inference.models.loader import _default_dtype

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
SUPPORTED_LAYOUT = (
    "an EAGLE-3 head for a Llama-family target: config.json (draft_vocab_size) plus weights "
    "fc.weight (hidden x 3*hidden), midlayer.* (one Llama decoder layer, q/k/v 2*hidden "
    "wide, hidden_norm), norm.weight, lm_head.weight (draft vocabulary x hidden), d2t; "
    "optional t2d, embed_tokens.weight"
)


def _raw_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no config.json; expected {SUPPORTED_LAYOUT}")
    return json.loads(path.read_text())


def aux_layer_ids(folder: Path, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input the head reads: the config's, else vLLM's default
    (2, L // 2, L - 3)."""
    raw = _raw_config(folder)
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (
        raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")  # fmt: skip
    if ids is None:
        ids = (2, num_target_layers // 2, num_target_layers - 3)
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3 or not all(0 < i < num_target_layers for i in ids):
        raise ValueError(f"EAGLE-3 head reads target layers {list(ids)}: three ids, each in "
                         f"1..{num_target_layers - 1}")
    return ids


def eagle3_head_config(folder: Path, target: ModelConfig) -> tuple[ModelConfig, int, bool]:
    """(the head's layer shape, its draft vocabulary size, norm_before_residual) from its
    ``config.json``; ValueError where it cannot draft for ``target``."""
    raw = _raw_config(folder)
    archs = raw.get("architectures") or []
    if not any(a in EAGLE3_ARCHITECTURES for a in archs):
        raise ValueError(f"EAGLE-3 head architecture {archs or '(none given)'} is not "
                         f"supported; supported: {list(EAGLE3_ARCHITECTURES)}")
    config = ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"]})
    if config.qkv_bias:
        raise ValueError(f"EAGLE-3 head with attention biases: supported is "
                         f"{SUPPORTED_LAYOUT}")
    if config.num_layers != 1:
        raise ValueError(f"EAGLE-3 head with {config.num_layers} layers: supported is "
                         f"{SUPPORTED_LAYOUT}")
    target_hidden = raw.get("target_hidden_size") or config.hidden_size
    if config.hidden_size != target.hidden_size or target_hidden != target.hidden_size:
        raise ValueError(f"EAGLE-3 head hidden_size {config.hidden_size} (target_hidden_size "
                         f"{target_hidden}) differs from the target's {target.hidden_size}")
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"EAGLE-3 head vocab_size {config.vocab_size} differs from the "
                         f"target's {target.vocab_size}")
    draft_vocab = int(raw.get("draft_vocab_size") or config.vocab_size)
    if not 0 < draft_vocab <= config.vocab_size:
        raise ValueError(f"EAGLE-3 draft_vocab_size {draft_vocab} must be in "
                         f"1..{config.vocab_size}")
    return config, draft_vocab, bool(raw.get("norm_before_residual", False))


class Eagle3Layer(DecoderLayer):
    """The head's decoder layer: q/k/v read ``[embedding, feature]`` (2H), both normed."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool) -> None:
        super().__init__(cfg, input_norm=False)
        self.qkv_proj = _empty(self.q_size + 2 * self.kv_size, 2 * cfg.hidden_size)
        self.embed_norm = _empty(cfg.hidden_size)  # input_layernorm in the checkpoint
        self.hidden_norm = _empty(cfg.hidden_size)
        self.norm_before_residual = norm_before_residual

    def forward(self, positions, embedded, feature, kv_cache, cos_sin_cache, meta):
        normed_feature = kernels.rms_norm(feature, self.hidden_norm, self.eps)
        residual = normed_feature if self.norm_before_residual else feature
        x = torch.cat([kernels.rms_norm(embedded, self.embed_norm, self.eps), normed_feature],
                      dim=-1)  # fmt: skip
        attended = self._attention(positions, x, kv_cache, cos_sin_cache, meta)
        normed, residual = kernels.fused_add_rms_norm(attended, residual,
                                                      self.post_attention_norm, self.eps)
        gated = kernels.silu_and_mul(_linear(normed, self.gate_up_proj))
        return _linear(gated, self.down_proj) + residual  # before the final norm


class Eagle3Head(nn.Module):
    """Reads a feature row per token: the target's three layers (3H, through ``fc``) or
    the head's own previous output (H); returns its outputs before the final norm (H),
    what ``draft_ids`` reads and drafting feeds back."""

    def __init__(self, cfg: ModelConfig, draft_vocab: int, max_position: int,
                 norm_before_residual: bool, own_embedding: bool) -> None:  # fmt: skip
        super().__init__()
        self.config = cfg
        hidden = cfg.hidden_size
        self.fc = _empty(hidden, 3 * hidden)
        self.layers = nn.ModuleList([Eagle3Layer(cfg, norm_before_residual)])
        self.norm = _empty(hidden)
        self.lm_head = _empty(draft_vocab, hidden)
        self.embed_tokens = _empty(cfg.vocab_size, hidden) if own_embedding else None
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64),
                             persistent=False)  # fmt: skip
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
        """``input_ids[t]`` is the token after the position whose feature is
        ``features[t]``; ``embed_tokens``: the target's table (unless the head has its
        own)."""
        table = self.embed_tokens if self.embed_tokens is not None else embed_tokens
        embedded = nn.functional.embedding(input_ids, table)
        feature = features.to(embedded.dtype)
        if feature.shape[-1] != self.config.hidden_size:  # the target's three layers
            feature = _linear(feature, self.fc)
        (layer,) = self.layers
        (kv_cache,) = kv_caches
        return layer(positions, embedded, feature, kv_cache, self.cos_sin_cache, meta)

    def draft_ids(self, outputs: torch.Tensor) -> torch.Tensor:
        """The target ids of the head's greedy guesses from ``outputs``."""
        normed = kernels.rms_norm(outputs, self.norm, self.config.rms_norm_eps)
        best = nn.functional.linear(normed, self.lm_head).argmax(dim=-1)
        return best + self.d2t[best]


def load_eagle3_head(
    folder: Path, cfg: ModelConfig, draft_vocab: int, norm_before_residual: bool,
    target_embed: torch.Tensor, dtype: torch.dtype, device: torch.device, max_position: int,
) -> Eagle3Head:
    """The head of ``folder`` on ``device``; ValueError, naming the supported layout, for
    weights it does not have, does not know, or of the wrong shape."""
    weights = {name.removeprefix("model."): w for name, w in read_head_weights(folder, device)}
    weights.pop("t2d", None)
    embed = weights.pop("embed_tokens.weight", None)
    if embed is not None and tuple(embed.shape) != tuple(target_embed.shape):
        raise ValueError(f"{folder}: embed_tokens.weight of shape {tuple(embed.shape)}, the "
                         f"target's {tuple(target_embed.shape)}")
    with _default_dtype(dtype), torch.device(device):
        head = Eagle3Head(cfg, draft_vocab, max_position, norm_before_residual,
                          own_embedding=embed is not None)  # fmt: skip
    head.cos_sin_cache = head.cos_sin_cache.to(device=device, dtype=torch.float32)
    d2t = weights.pop("d2t", None)
    if d2t is None:
        if draft_vocab != cfg.vocab_size:
            raise ValueError(f"{folder}: no d2t for a draft vocabulary of {draft_vocab} "
                             f"(target {cfg.vocab_size}); expected {SUPPORTED_LAYOUT}")
    else:
        if tuple(d2t.shape) != (draft_vocab,) or d2t.is_floating_point():
            raise ValueError(f"{folder}: d2t must be {draft_vocab} integers, got "
                             f"{d2t.dtype} {tuple(d2t.shape)}")
        ids = torch.arange(draft_vocab, device=d2t.device) + d2t.long()
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"{folder}: d2t maps draft ids outside the target's vocabulary "
                             f"of {cfg.vocab_size}")
        head.d2t.copy_(d2t.long())
    layer = "layers.0."
    dim, q = cfg.head_dim, cfg.num_heads * cfg.head_dim
    kv, inter = cfg.num_kv_heads * dim, cfg.intermediate_size
    where = {  # checkpoint name -> (parameter, its rows or None for all)
        "fc.weight": ("fc", None), "norm.weight": ("norm", None),
        "lm_head.weight": ("lm_head", None),
        "midlayer.input_layernorm.weight": (layer + "embed_norm", None),
        "midlayer.hidden_norm.weight": (layer + "hidden_norm", None),
        "midlayer.post_attention_layernorm.weight": (layer + "post_attention_norm", None),
        "midlayer.self_attn.q_proj.weight": (layer + "qkv_proj", (0, q)),
        "midlayer.self_attn.k_proj.weight": (layer + "qkv_proj", (q, kv)),
        "midlayer.self_attn.v_proj.weight": (layer + "qkv_proj", (q + kv, kv)),
        "midlayer.self_attn.o_proj.weight": (layer + "o_proj", None),
        "midlayer.mlp.gate_proj.weight": (layer + "gate_up_proj", (0, inter)),
        "midlayer.mlp.up_proj.weight": (layer + "gate_up_proj", (inter, inter)),
        "midlayer.mlp.down_proj.weight": (layer + "down_proj", None),
    }  # fmt: skip
    unknown = sorted(set(weights) - set(where))
    missing = sorted(set(where) - set(weights))
    if unknown or missing:
        raise ValueError(f"{folder}: " + "; ".join(
            part for part in (f"unexpected weights {unknown}" if unknown else "",
                              f"missing weights {missing}" if missing else "") if part)
            + f"; expected {SUPPORTED_LAYOUT}")  # fmt: skip
    with torch.no_grad():
        for name, (param_name, rows) in where.items():
            param = head.get_parameter(param_name)
            dest = param.data if rows is None else param.data.narrow(0, *rows)
            weight = weights[name]
            if tuple(dest.shape) != tuple(weight.shape):
                raise ValueError(f"{folder}: weight {name} has shape {tuple(weight.shape)}, "
                                 f"expected {tuple(dest.shape)}")
            dest.copy_(weight)
        if embed is not None:
            head.embed_tokens.copy_(embed)
    return head.eval()
