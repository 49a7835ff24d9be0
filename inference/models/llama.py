"""The Llama block and its relatives (Mistral, Qwen2/2.5 with qkv bias, Qwen3 with q/k
norm), written against the kernels' ops so the same file runs on CPU (torch references)
and GPU (Triton).

Projections are fused where the weights allow it: q, k and v in one matrix, gate and up
in another, so a layer launches a handful of kernels rather than a dozen.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from inference.layers.attention_metadata import AttentionMetadata
from inference.layers.rotary import build_cos_sin_cache
from inference.models.config import ModelConfig


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.input_norm = _empty(cfg.hidden_size)
        self.qkv_proj = _empty(self.q_size + 2 * self.kv_size, cfg.hidden_size)
        self.qkv_bias = _empty(self.q_size + 2 * self.kv_size) if cfg.qkv_bias else None
        self.q_norm = _empty(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = _empty(cfg.head_dim) if cfg.qk_norm else None
        self.o_proj = _empty(cfg.hidden_size, self.q_size)
        self.post_attention_norm = _empty(cfg.hidden_size)
        self.gate_up_proj = _empty(2 * cfg.intermediate_size, cfg.hidden_size)
        self.down_proj = _empty(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = kernels.rms_norm(hidden, self.input_norm, self.eps)
        else:
            hidden, residual = kernels.fused_add_rms_norm(
                hidden, residual, self.input_norm, self.eps
            )
        hidden = self._attention(positions, hidden, kv_cache, cos_sin_cache, meta)
        hidden, residual = kernels.fused_add_rms_norm(
            hidden, residual, self.post_attention_norm, self.eps
        )
        gate_up = nn.functional.linear(hidden, self.gate_up_proj)
        hidden = nn.functional.linear(kernels.silu_and_mul(gate_up), self.down_proj)
        return hidden, residual

    def _attention(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = nn.functional.linear(hidden, self.qkv_proj, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = kernels.rms_norm(q.reshape(-1, self.head_dim), self.q_norm, self.eps).view_as(q)
            k = kernels.rms_norm(k.reshape(-1, self.head_dim), self.k_norm, self.eps).view_as(k)
        k_cache, v_cache = kv_cache
        q, k = kernels.rotary_embedding_with_kv_cache(
            positions, q, k, v, cos_sin_cache, k_cache, v_cache, meta.slot_mapping
        )
        out = kernels.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
            max_query_len=meta.max_query_len,
        )
        return nn.functional.linear(out.reshape(num_tokens, self.q_size), self.o_proj)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = _empty(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = _empty(cfg.hidden_size)
        self.lm_head = None if cfg.tie_word_embeddings else _empty(cfg.vocab_size, cfg.hidden_size)
        self.register_buffer(
            "cos_sin_cache",
            build_cos_sin_cache(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling),
            persistent=False,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        hidden = nn.functional.embedding(input_ids, self.embed_tokens)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, self.cos_sin_cache, meta)
        hidden, _ = kernels.fused_add_rms_norm(hidden, residual, self.norm, self.config.rms_norm_eps)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return nn.functional.linear(hidden, weight).float()

    # -- weights -----------------------------------------------------------------------
    def load_weights(self, weights) -> None:
        """Copy (name, tensor) pairs in Hugging Face naming into the fused parameters."""
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv_slices = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv)}
        inter = cfg.intermediate_size
        gate_up_slices = {"gate_proj": (0, inter), "up_proj": (inter, inter)}
        loaded: set[str] = set()
        for name, tensor in weights:
            target, rows = self._map_weight(name, qkv_slices, gate_up_slices)
            if target is None:
                continue
            param = self.get_parameter(target)
            dest = param.data if rows is None else param.data.narrow(0, *rows)
            if dest.shape != tensor.shape:
                raise ValueError(f"weight {name}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(f"{target}:{rows}")
        self._check_all_loaded(loaded)

    def _map_weight(self, name: str, qkv_slices: dict, gate_up_slices: dict):
        if name.startswith("model."):
            name = name[len("model.") :]
        if "rotary_emb" in name:
            return None, None
        if name == "embed_tokens.weight":
            return "embed_tokens", None
        if name == "norm.weight":
            return "norm", None
        if name == "lm_head.weight":
            return (None, None) if self.lm_head is None else ("lm_head", None)
        if not name.startswith("layers."):
            raise ValueError(f"unexpected weight {name!r}")
        _, idx, module, *rest = name.split(".")
        prefix = f"layers.{idx}."
        leaf = ".".join(rest)
        if module == "input_layernorm":
            return prefix + "input_norm", None
        if module == "post_attention_layernorm":
            return prefix + "post_attention_norm", None
        if module == "self_attn":
            proj, kind = rest[0], rest[-1]
            if proj in qkv_slices:
                return prefix + ("qkv_proj" if kind == "weight" else "qkv_bias"), qkv_slices[proj]
            if proj == "o_proj" and kind == "weight":
                return prefix + "o_proj", None
            if proj in ("q_norm", "k_norm"):
                return prefix + proj, None
        if module == "mlp":
            proj = rest[0]
            if proj in gate_up_slices:
                return prefix + "gate_up_proj", gate_up_slices[proj]
            if proj == "down_proj":
                return prefix + "down_proj", None
        raise ValueError(f"unexpected weight {name!r} ({module}.{leaf})")

    def _check_all_loaded(self, loaded: set[str]) -> None:
        cfg = self.config
        expected = 2 + (0 if self.lm_head is None else 1)
        per_layer = 9 + (3 if cfg.qkv_bias else 0) + (2 if cfg.qk_norm else 0)
        expected += per_layer * cfg.num_layers
        if len(loaded) != expected:
            raise ValueError(
                f"checkpoint provided {len(loaded)} of {expected} weight tensors; "
                "some weights are missing"
            )
