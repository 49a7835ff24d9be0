"""Weight quantization: which scheme a model runs with, decided once from the engine's
``quantization`` setting and the checkpoint's ``quantization_config``.

Two families of schemes exist. ``fp8`` (vLLM's): every linear projection of the decoder layers (qkv,
o, gate_up, down) holds float8_e4m3fn weights with one float32 scale per output channel,
and activations are quantized per token at run time; embeddings, the LM head and the
norms stay in the model's dtype. It is reached three ways:

- ``quantization="fp8"`` on a bf16/fp16/fp32 checkpoint: quantized while loading;
- a Hugging Face ``quant_method: "fp8"`` checkpoint (dynamic activations, per-tensor or
  block-wise ``weight_scale_inv``, e.g. ``weight_block_size: [128, 128]`` as the Qwen FP8
  releases);
- a ``compressed-tensors`` FP8 checkpoint (per-channel or per-tensor ``weight_scale``,
  dynamic per-token activations: the "FP8-dynamic" releases).

And 4-bit weights with 16-bit activations (W4A16), loaded as their checkpoints store
them: ``awq``, ``gptq`` and ``compressed-tensors`` ``pack-quantized`` (``int4_config.py``;
one int4 linear for all three, ``int4.py``). There is no online int4 quantization.

A quantized checkpoint is detected from its config (no flag needed, as vLLM; the flag,
given, must name the checkpoint's own method); anything else (3- or 8-bit GPTQ, static
activation scales, an FP8 KV cache scheme, ...) is refused here, at configuration time,
with what is supported. This module is torch-free so that the
engine's configuration resolves without it; the tensors' side is ``fp8.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inference.quantization.int4_config import (
    INT4_METHODS,
    SUPPORTED_INT4,
    Int4Checkpoint,
    awq_checkpoint,
    check_tensor_parallel,
    compressed_tensors_checkpoint,
    gptq_checkpoint,
    is_int4_compressed_tensors,
)

QUANTIZATION_METHODS = ("fp8", *INT4_METHODS)
SUPPORTED_CHECKPOINTS = (
    'quant_method "fp8" (fmt e4m3, activation_scheme "dynamic", per-tensor or block-wise '
    'weight scales) and "compressed-tensors" FP8 (float 8-bit weights with "channel", '
    '"tensor" or "block" scales, dynamic per-token or no input activation quantization, no '
    "kv_cache_scheme); " + SUPPORTED_INT4
)


@dataclass(frozen=True)
class Fp8Checkpoint:
    """How an FP8 checkpoint stores its weights."""

    quant_method: str  # "fp8" or "compressed-tensors"
    # Rows x columns one scale covers, for block-wise scales; None: per channel or tensor.
    block_size: tuple[int, int] | None = None


def _unsupported(why: str) -> ValueError:
    return ValueError(f"unsupported quantization_config: {why}; supported: {SUPPORTED_CHECKPOINTS}")


def checkpoint_scheme(
    quantization_config: dict[str, Any] | None,
) -> Fp8Checkpoint | Int4Checkpoint | None:
    """The layout of a checkpoint's ``quantization_config`` (None: not quantized).
    ValueError for any other quantization, naming what is supported."""
    if not quantization_config:
        return None
    method = quantization_config.get("quant_method")
    if method == "fp8":
        return _hf_fp8(quantization_config)
    if method == "awq":
        return awq_checkpoint(quantization_config)
    if method == "gptq":
        return gptq_checkpoint(quantization_config)
    if method == "compressed-tensors":
        if is_int4_compressed_tensors(quantization_config):
            return compressed_tensors_checkpoint(quantization_config)
        return _compressed_tensors(quantization_config)
    raise _unsupported(f"quant_method {method!r}")


def _block_size(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, list | tuple) or len(value) != 2
            or not all(isinstance(v, int) and v > 0 for v in value)):  # fmt: skip
        raise _unsupported(f"weight block size {value!r} (expected [rows, columns])")
    return int(value[0]), int(value[1])


def _hf_fp8(config: dict[str, Any]) -> Fp8Checkpoint:
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _unsupported(f'fp8 format {fmt!r} (only "e4m3")')
    activations = config.get("activation_scheme", "dynamic")
    if activations != "dynamic":
        raise _unsupported(f'activation_scheme {activations!r} (static activation scales)')
    return Fp8Checkpoint("fp8", _block_size(config.get("weight_block_size")))


def _compressed_tensors(config: dict[str, Any]) -> Fp8Checkpoint:
    if config.get("kv_cache_scheme"):
        raise _unsupported("compressed-tensors kv_cache_scheme (an FP8 KV cache checkpoint)")
    groups = config.get("config_groups") or {}
    if not groups:
        raise _unsupported("compressed-tensors without config_groups")
    blocks = set()
    for name, group in groups.items():
        weights = group.get("weights") or {}
        if (weights.get("type"), weights.get("num_bits")) != ("float", 8):
            raise _unsupported(
                f"compressed-tensors group {name!r} weights of type {weights.get('type')!r} "
                f"with {weights.get('num_bits')} bits (only float 8-bit: FP8)"
            )
        strategy = weights.get("strategy")
        if strategy not in ("channel", "tensor", "block") or weights.get("dynamic"):
            raise _unsupported(f"compressed-tensors weight strategy {strategy!r}")
        blocks.add(_block_size(weights.get("block_structure")) if strategy == "block" else None)
        inputs = group.get("input_activations")
        if inputs is not None and not (
            inputs.get("dynamic") and inputs.get("type", "float") == "float"
            and inputs.get("num_bits", 8) == 8 and inputs.get("strategy") in ("token", "tensor")
        ):  # fmt: skip
            raise _unsupported(
                f"compressed-tensors group {name!r} input activations {inputs!r} (static "
                "activation scales)"
            )
    if len(blocks) != 1:
        raise _unsupported("compressed-tensors groups with different weight layouts")
    return Fp8Checkpoint("compressed-tensors", blocks.pop())


def resolve_quantization(
    requested: str | None, quantization_config: dict[str, Any] | None
) -> str | None:
    """The scheme the model runs with: the checkpoint's own when it is quantized (the
    request must then agree), else the request (online quantization: fp8 only) or None.
    An int4 checkpoint runs as its method ("awq", "gptq", "compressed-tensors")."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization must be one of {list(QUANTIZATION_METHODS)}, got {requested!r}"
        )
    scheme = checkpoint_scheme(quantization_config)
    if isinstance(scheme, Int4Checkpoint):
        if requested not in (None, scheme.method):
            raise ValueError(f"quantization {requested!r} requested, but the checkpoint is "
                             f"{scheme.method} 4-bit (leave it unset, or {scheme.method!r})")
        return scheme.method
    if scheme is not None:
        if requested not in (None, "fp8", scheme.quant_method):
            raise ValueError(f"quantization {requested!r} requested, but the checkpoint is "
                             f"{scheme.quant_method} FP8 (leave it unset, or 'fp8')")
        return "fp8"
    if requested in INT4_METHODS:
        raise ValueError(
            f"quantization {requested!r} needs a checkpoint quantized that way (its config.json "
            "names it in quantization_config); a full-precision checkpoint can be quantized "
            "at load only to fp8"
        )
    return requested


def check_sharding(quantization_config: dict[str, Any] | None, model_config: Any,
                   world: int) -> None:  # fmt: skip
    """ValueError, before any worker starts, where ``world`` tensor-parallel ranks cannot
    shard a 4-bit checkpoint's row-parallel projections (o_proj, down_proj) on group
    boundaries. ``model_config``: the ``ModelConfig`` (torch-free here)."""
    scheme = checkpoint_scheme(quantization_config)
    if isinstance(scheme, Int4Checkpoint):
        inputs = {"o_proj": model_config.num_heads * model_config.head_dim,
                  "down_proj": model_config.intermediate_size}  # fmt: skip
        check_tensor_parallel(scheme, inputs, world)
