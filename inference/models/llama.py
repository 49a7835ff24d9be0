"""The Llama block and its relatives (Mistral, Qwen2/2.5 with qkv bias, Qwen3 with q/k
norm), written against the kernels' ops so the same file runs on CPU (torch references)
and GPU (Triton).

Projections are fused where the weights allow it: q, k and v in one matrix, gate and up
in another, so a layer launches a handful of kernels rather than a dozen.

Tensor parallelism (Megatron style): with ``parallel.world_size > 1`` each rank holds its
share of the query heads, its KV heads (an equal share, or one replicated head when there
are fewer KV heads than ranks), its rows of gate/up and the matching columns of o_proj and
down_proj, and a slice of the vocabulary; o_proj's and down_proj's partial sums and the
embedding are all-reduced, the LM head's logits all-gathered. ``ModelConfig`` stays the
global shape; the local sizes follow from (config, rank, world size).

FP8 (``quantization="fp8"``): the four projections of each layer are float8_e4m3fn with a
float32 scale per output row (``<name>_scale``) and run through ``kernels.fp8_linear``;
``inference/quantization/fp8.py`` fills them from whatever the checkpoint holds. Where a
step's projection would quantize its input in a launch of its own
(``kernels.wants_fp8_input``), the op before it writes that input quantized instead: the
input norm for qkv, the post-attention norm for gate_up, and SiLU-and-mul for down past
decode-sized steps (the bf16 residual stream is the same either way).

4-bit weights (an AWQ, GPTQ or compressed-tensors checkpoint): the four projections are
``quantization.int4.Int4Weights`` modules (packed codes, group scales and zero points, run
through ``kernels.int4_linear``); activations stay in the model's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

import pagoda_kernels as kernels
from inference.layers.attention_metadata import AttentionMetadata
from inference.layers.embedding import vocab_parallel_embedding, vocab_parallel_logits
from inference.layers.kv_cache import check_kv_scale, kv_scale_kind
from inference.layers.rotary import build_cos_sin_cache
from inference.models.config import ModelConfig
from inference.parallel_state import (
    SINGLE,
    ParallelContext,
    kv_head_range,
    vocab_range,
)
from inference.quantization import INT4_METHODS, checkpoint_scheme, fp8, int4
from pagoda_kernels.linear import MAX_M as SKINNY_MAX_M

# Decode-sized steps go through kernels.linear (a Triton skinny GEMM where it beats cuBLAS);
# larger ones straight to cuBLAS, without the dispatch's per-call Python.
_SKINNY_MAX_TOKENS = SKINNY_MAX_M


def _linear(
    x: torch.Tensor | kernels.Fp8Activations,
    weight: torch.Tensor | int4.Int4Weights,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    if isinstance(weight, int4.Int4Weights):
        return weight(x, bias, out)
    if scale is not None:  # an FP8 projection
        return kernels.fp8_linear(x, weight, scale, bias, out)
    if x.shape[0] <= _SKINNY_MAX_TOKENS:
        return kernels.linear(x, weight, bias, out)
    return kernels.linear_ref(x, weight, bias, out)


def _empty(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, parallel: ParallelContext = SINGLE,
        quantization: str | None = None, input_norm: bool = True,
    ) -> None:  # fmt: skip
        """``input_norm=False``: the layer reads its input as it is (an EAGLE head's first
        layer, ``inference.models.eagle``)."""
        super().__init__()
        self.parallel = parallel
        world = parallel.world_size
        self.num_heads = cfg.num_heads // world  # this rank's query heads
        _, self.num_kv_heads = kv_head_range(cfg.num_kv_heads, parallel.rank, world)
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        intermediate = cfg.intermediate_size // world
        self.input_norm = _empty(cfg.hidden_size) if input_norm else None
        self.qkv_bias = _empty(self.q_size + 2 * self.kv_size) if cfg.qkv_bias else None
        self.q_norm = _empty(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = _empty(cfg.head_dim) if cfg.qk_norm else None
        self.post_attention_norm = _empty(cfg.hidden_size)
        # Column-parallel (output rows split): qkv and gate/up; row-parallel (input
        # columns split, partial sums all-reduced): o_proj and down_proj.
        shapes = {
            "qkv_proj": (self.q_size + 2 * self.kv_size, cfg.hidden_size),
            "o_proj": (cfg.hidden_size, self.q_size),
            "gate_up_proj": (2 * intermediate, cfg.hidden_size),
            "down_proj": (cfg.hidden_size, intermediate),
        }
        quantized = quantization == "fp8"
        int4_scheme = checkpoint_scheme(cfg.quantization_config) if (
            quantization in INT4_METHODS) else None  # fmt: skip
        for name, (rows, cols) in shapes.items():
            if int4_scheme is not None:
                full = cols * world if name in ("o_proj", "down_proj") else cols
                setattr(self, name, int4.Int4Weights(rows, cols, full, int4_scheme, name))
                setattr(self, name + "_scale", None)
                continue
            setattr(self, name, _empty(rows, cols, dtype=fp8.FP8_DTYPE if quantized else None))
            setattr(self, name + "_scale",
                    _empty(rows, dtype=torch.float32) if quantized else None)  # fmt: skip
        # An FP8 KV cache's per-layer scales (read only when the cache is FP8): 1.0 unless
        # the checkpoint has them (inference/layers/kv_cache.py).
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        # LoRA adapters (``inference.lora.device.LayerLoRA``), when the engine serves them:
        # each projection's output gets its rows' adapter updates.
        self.lora = None

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens, dtype = hidden.shape[0], hidden.dtype
        fp8_qkv, fp8_gate_up, fp8_down = self._fp8_inputs(num_tokens, dtype)
        if residual is None:
            residual = hidden
            norm = kernels.rms_norm_fp8 if fp8_qkv else kernels.rms_norm
            normed = (hidden if self.input_norm is None
                      else norm(hidden, self.input_norm, self.eps))  # fmt: skip
        else:
            add_norm = kernels.fused_add_rms_norm_fp8 if fp8_qkv else kernels.fused_add_rms_norm
            normed, residual = add_norm(hidden, residual, self.input_norm, self.eps)
        hidden = self._attention(positions, normed, kv_cache, cos_sin_cache, meta)
        add_norm = kernels.fused_add_rms_norm_fp8 if fp8_gate_up else kernels.fused_add_rms_norm
        normed, residual = add_norm(hidden, residual, self.post_attention_norm, self.eps)
        if self.lora is not None:  # the update joins gate/up before the activation
            gate_up = _linear(normed, self.gate_up_proj, scale=self.gate_up_proj_scale)
            gated = kernels.silu_and_mul(self.lora.add("gate_up_proj", normed, gate_up))
        elif self.gate_up_proj_scale is not None:
            gate_up = kernels.fp8_linear(normed, self.gate_up_proj, self.gate_up_proj_scale)
            gated = (kernels.silu_and_mul_fp8 if fp8_down else kernels.silu_and_mul)(gate_up)
        elif isinstance(self.gate_up_proj, int4.Int4Weights):
            gated = kernels.silu_and_mul(self.gate_up_proj(normed))
        elif num_tokens <= _SKINNY_MAX_TOKENS:
            gated = kernels.linear_silu_and_mul(normed, self.gate_up_proj)
        else:
            gated = kernels.silu_and_mul(nn.functional.linear(normed, self.gate_up_proj))
        # Row-parallel: written straight into the all-reduce's staging buffer where it has one.
        staging = self.parallel.all_reduce_input(num_tokens, self.down_proj.shape[0], dtype)
        hidden = _linear(gated, self.down_proj, out=staging, scale=self.down_proj_scale)
        if self.lora is not None:
            hidden = self.lora.add("down_proj", gated, hidden)
        return self.parallel.all_reduce(hidden), residual

    def _fp8_inputs(self, num_tokens: int, dtype: torch.dtype) -> tuple[bool, bool, bool]:
        """Whether the FP8 qkv, gate_up and down projections of this step want their
        inputs quantized by the norm / SiLU-and-mul that writes them (one launch fewer each,
        where the projection would otherwise quantize in a launch of its own): decided by
        the step's shape, so a CUDA graph replays what it captured. Never in full precision,
        nor where the projection quantizes inside its own kernel (batch 1, fma kind)."""
        # LoRA reads each projection's input in the model's dtype.
        if self.qkv_proj_scale is None or self.lora is not None:
            return False, False, False
        return (
            kernels.wants_fp8_input(num_tokens, self.qkv_proj, dtype, self.qkv_bias),
            kernels.wants_fp8_input(num_tokens, self.gate_up_proj, dtype),
            # SiLU-and-mul quantizes with one program per row (the scale needs the whole
            # row), too few programs for a decode-sized step: measured slower there on an
            # H200 (batch 1: 1.5B 786 -> 745 tok/s, 7B 361 -> 347), so only past the
            # skinny GEMM's range.
            num_tokens > kernels.FP8_SKINNY_MAX_M
            and kernels.wants_fp8_input(num_tokens, self.down_proj, dtype),
        )

    def _attention(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor | kernels.Fp8Activations,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = positions.shape[0]
        qkv = _linear(hidden, self.qkv_proj, self.qkv_bias, scale=self.qkv_proj_scale)
        if self.lora is not None:
            qkv = self.lora.add("qkv_proj", hidden, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = kernels.rms_norm(q.reshape(-1, self.head_dim), self.q_norm, self.eps).view_as(q)
            k = kernels.rms_norm(k.reshape(-1, self.head_dim), self.k_norm, self.eps).view_as(k)
        k_cache, v_cache = kv_cache
        q, k = kernels.rotary_embedding_with_kv_cache(
            positions, q, k, v, cos_sin_cache, k_cache, v_cache, meta.slot_mapping,
            self.k_scale, self.v_scale,
        )  # fmt: skip
        out = kernels.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
            max_query_len=meta.max_query_len,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            long_prefills=meta.long_prefills,
        )
        staging = self.parallel.all_reduce_input(num_tokens, self.o_proj.shape[0], out.dtype)
        attended = out.reshape(num_tokens, self.q_size)
        out = _linear(attended, self.o_proj, out=staging, scale=self.o_proj_scale)
        if self.lora is not None:
            out = self.lora.add("o_proj", attended, out)
        return self.parallel.all_reduce(out)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, cfg: ModelConfig, max_position: int, parallel: ParallelContext = SINGLE,
        quantization: str | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.parallel = parallel
        # This rank's vocabulary rows (all of them without tensor parallelism).
        self.vocab_start, vocab_rows, self.vocab_rows_valid = vocab_range(
            cfg.vocab_size, parallel.rank, parallel.world_size
        )
        self.embed_tokens = _empty(vocab_rows, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, parallel, quantization) for _ in range(cfg.num_layers)
        )
        self.norm = _empty(cfg.hidden_size)
        self.lm_head = None if cfg.tie_word_embeddings else _empty(vocab_rows, cfg.hidden_size)
        self.register_buffer(
            "cos_sin_cache",
            build_cos_sin_cache(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling),
            persistent=False,
        )
        # An EAGLE-3 head reads the residual stream entering some layers (``keep_aux``).
        self.aux_layers: tuple[int, ...] = ()
        self.aux_states: torch.Tensor | None = None

    def keep_aux(self, layers: tuple[int, ...], max_tokens: int) -> None:
        """From now on each forward also writes the residual stream entering ``layers``
        into ``aux_states`` [max_tokens, len(layers), hidden] (a fixed buffer: CUDA graphs
        captured after this write it too), row t for token t."""
        self.aux_layers = tuple(layers)
        self.aux_states = torch.zeros(max_tokens, len(layers), self.config.hidden_size,
                                      dtype=self.embed_tokens.dtype,
                                      device=self.embed_tokens.device)  # fmt: skip

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        if self.parallel.is_parallel:
            hidden = vocab_parallel_embedding(
                input_ids, self.embed_tokens, self.vocab_start, self.parallel
            )
        else:
            hidden = nn.functional.embedding(input_ids, self.embed_tokens)
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if i in self.aux_layers:
                stream = hidden if residual is None else hidden + residual
                for slot, layer_id in enumerate(self.aux_layers):  # an id may repeat
                    if layer_id == i:
                        self.aux_states[: len(stream), slot].copy_(stream)
            hidden, residual = layer(positions, hidden, residual, kv_cache, self.cos_sin_cache, meta)
        hidden, _ = kernels.fused_add_rms_norm(hidden, residual, self.norm, self.config.rms_norm_eps)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        if self.parallel.is_parallel:
            vocab_size = self.config.vocab_size
            return vocab_parallel_logits(hidden, weight, vocab_size, self.parallel).float()
        return nn.functional.linear(hidden, weight).float()

    # -- weights -----------------------------------------------------------------------
    def load_weights(self, weights) -> None:
        """Copy (name, weight) pairs in Hugging Face naming into the fused parameters. A
        weight is a tensor or a lazy safetensors entry (``loader.SafetensorsWeight``); of a
        lazy one, a rank reads only its shard."""
        shards = self._shard_table()
        loaded: set[str] = set()
        for name, weight in weights:
            if self._load_kv_scale(name, weight):
                continue
            placement = self._map_weight(name, shards)
            if placement is None:
                continue
            target, rows, source = placement
            projection = int4_projection(self, target)
            if projection is not None:
                int4.load_projection(projection, rows, weight, source, name)
                loaded.add(f"{target}:{rows}")
                continue
            param = self.get_parameter(target)
            if param.dtype == fp8.FP8_DTYPE:
                scale = self.get_parameter(target + "_scale")
                fp8.load_projection(param, scale, rows, weight, source, name)
                loaded.add(f"{target}:{rows}")
                continue
            if isinstance(weight, int4.Int4CheckpointWeight):
                raise ValueError(f"weight {name}: 4-bit in the checkpoint, but this engine "
                                 "keeps it in full precision (embeddings, LM head, norms)")
            if isinstance(weight, fp8.Fp8CheckpointWeight):
                raise ValueError(f"weight {name}: FP8 in the checkpoint, but this engine "
                                 "keeps it in full precision (embeddings, LM head, norms)")
            dest = param.data if rows is None else param.data.narrow(0, *rows)
            tensor = fp8.read_part(weight, source)
            if dest.shape != tensor.shape:
                raise ValueError(f"weight {name}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(f"{target}:{rows}")
        if self.vocab_rows_valid < self.embed_tokens.shape[0]:  # padding rows of the last rank
            for param in (self.embed_tokens, self.lm_head):
                if param is not None:
                    param.data[self.vocab_rows_valid :].zero_()
        self._check_all_loaded(loaded)

    def _load_kv_scale(self, name: str, weight) -> bool:
        """Copy a KV-cache scale (``layers.N.self_attn.k_scale`` and vLLM's other names)
        into its layer; False for any other tensor."""
        parts = name.removeprefix("model.").split(".")
        if len(parts) < 4 or parts[0] != "layers" or parts[2] != "self_attn":
            return False
        kind = kv_scale_kind(".".join(parts[3:]))
        if kind is None:
            return False
        value = check_kv_scale(name, weight if isinstance(weight, torch.Tensor) else weight.read())
        layer = self.layers[int(parts[1])]
        targets = {"k": [layer.k_scale], "v": [layer.v_scale], "kv": [layer.k_scale, layer.v_scale]}
        for buffer in targets[kind]:
            buffer.fill_(value)
        return True

    def _shard_table(self) -> dict[str, tuple[tuple[int, int] | None, _Source]]:
        """For each Hugging Face projection (and the vocabulary): where it lands in the
        fused parameter (rows, or None for all of it) and which part of the checkpoint
        tensor this rank reads (dim, start, length; dim None: all of it)."""
        cfg, rank, world = self.config, self.parallel.rank, self.parallel.world_size
        dim = cfg.head_dim
        q = cfg.num_heads // world * dim
        kv_first, kv_heads = kv_head_range(cfg.num_kv_heads, rank, world)
        kv = kv_heads * dim
        inter = cfg.intermediate_size // world
        whole = (None, 0, 0)
        if world == 1:
            q_src = k_src = o_src = gate_src = down_src = whole
            vocab_src = whole
        else:
            q_src, k_src = (0, rank * q, q), (0, kv_first * dim, kv)
            o_src = (1, rank * q, q)
            gate_src, down_src = (0, rank * inter, inter), (1, rank * inter, inter)
            vocab_src = (0, self.vocab_start, self.vocab_rows_valid)
        return {
            "q_proj": ((0, q), q_src),
            "k_proj": ((q, kv), k_src),
            "v_proj": ((q + kv, kv), k_src),
            "o_proj": (None, o_src),
            "gate_proj": ((0, inter), gate_src),
            "up_proj": ((inter, inter), gate_src),
            "down_proj": (None, down_src),
            # Without padding the vocabulary fills the parameter: rows None as before.
            "vocab": (
                None if self.vocab_rows_valid == self.embed_tokens.shape[0]
                else (0, self.vocab_rows_valid),
                vocab_src,
            ),
        }

    def _map_weight(self, name: str, shards: dict):
        """(parameter name, its rows or None, the part of the tensor to read) or None for
        a weight the model does not use."""
        if name.startswith("model."):
            name = name[len("model.") :]
        whole = (None, 0, 0)
        if "rotary_emb" in name:
            return None
        if name == "embed_tokens.weight":
            return ("embed_tokens", *shards["vocab"])
        if name == "norm.weight":
            return "norm", None, whole
        if name == "lm_head.weight":
            return None if self.lm_head is None else ("lm_head", *shards["vocab"])
        if not name.startswith("layers."):
            raise ValueError(f"unexpected weight {name!r}")
        _, idx, module, *rest = name.split(".")
        prefix = f"layers.{idx}."
        leaf = ".".join(rest)
        if module == "input_layernorm":
            return prefix + "input_norm", None, whole
        if module == "post_attention_layernorm":
            return prefix + "post_attention_norm", None, whole
        if module == "self_attn":
            proj, kind = rest[0], rest[-1]
            if proj in ("q_proj", "k_proj", "v_proj"):
                return (prefix + ("qkv_proj" if kind == "weight" else "qkv_bias"), *shards[proj])
            if proj == "o_proj" and kind == "weight":
                return (prefix + "o_proj", *shards[proj])
            if proj in ("q_norm", "k_norm"):
                return prefix + proj, None, whole
        if module == "mlp":
            proj = rest[0]
            if proj in ("gate_proj", "up_proj", "down_proj"):
                target = "down_proj" if proj == "down_proj" else "gate_up_proj"
                return (prefix + target, *shards[proj])
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


def int4_projection(model: nn.Module, target: str) -> int4.Int4Weights | None:
    """The 4-bit projection module named ``target``, or None for a parameter."""
    parent, _, leaf = target.rpartition(".")
    found = getattr(model.get_submodule(parent) if parent else model, leaf, None)
    return found if isinstance(found, int4.Int4Weights) else None


# (dim, start, length) of a checkpoint tensor; dim None: the whole tensor.
_Source = tuple[int | None, int, int]
