"""4-bit weight-only checkpoints (W4A16) as their ``quantization_config`` declares them:
AutoAWQ's GEMM layout, GPTQ (AutoGPTQ / GPTQModel) and compressed-tensors
``pack-quantized``. Torch-free, like the rest of the configuration; the tensors' side is
``int4.py`` and the per-format decoders ``awq.py``, ``gptq.py``, ``compressed_tensors.py``.

Every format means the same thing: ``weight[n, k] = (q[n, k] - zero[n, g]) * scale[n, g]``
with 4-bit codes q in 0..15, ``g = k // group_size`` (or ``g_idx[k]`` for GPTQ's
``desc_act`` / compressed-tensors' ``actorder: group``), one group over all of K for a
per-channel scheme, and zero 8 for a symmetric one. What differs is where the codes sit in
the int32 words and the zero-point convention (GPTQ's v1 format stores zero - 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

INT4_METHODS = ("awq", "gptq", "compressed-tensors")
SUPPORTED_INT4 = (
    'quant_method "awq" (4-bit, version "gemm", zero points), "gptq" (4-bit, sym or asym, '
    'any group size, desc_act, checkpoint_format "gptq" or "gptq_v2") and '
    '"compressed-tensors" format "pack-quantized" (int 4-bit weights, strategy "group" or '
    '"channel", no input activation quantization)'
)


@dataclass(frozen=True)
class Int4Checkpoint:
    """How a 4-bit checkpoint stores its projections."""

    method: str  # "awq", "gptq" or "compressed-tensors"
    group_size: int  # -1: one group over all of K (per channel)
    symmetric: bool = False
    act_order: bool = False  # groups given by a stored g_idx, not by k // group_size
    # Added to every stored zero point: 1 in GPTQ's v1 format, else 0.
    zero_offset: int = 0


class UnsupportedInt4(ValueError):
    """A 4-bit checkpoint this engine cannot run; the message names what it can."""


def _refuse(why: str) -> UnsupportedInt4:
    return UnsupportedInt4(f"unsupported quantization_config: {why}; supported: {SUPPORTED_INT4}")


def _group_size(value: Any) -> int:
    if value in (-1, None):
        return -1
    if not isinstance(value, int) or value <= 0 or value % 8:
        raise _refuse(f"group_size {value!r} (a positive multiple of 8, or -1 per channel)")
    return value


def awq_checkpoint(config: dict[str, Any]) -> Int4Checkpoint:
    bits = config.get("bits", config.get("w_bit", 4))
    if bits != 4:
        raise _refuse(f"AWQ with {bits} bits")
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(f'AWQ version {version!r} (only the "gemm" layout)')
    if config.get("modules_to_not_convert"):
        raise _refuse(f"AWQ modules_to_not_convert {config['modules_to_not_convert']!r}")
    zero_point = config.get("zero_point", True)
    size = _group_size(config.get("group_size", config.get("q_group_size", 128)))
    return Int4Checkpoint("awq", size, symmetric=not zero_point)


def gptq_checkpoint(config: dict[str, Any]) -> Int4Checkpoint:
    bits = config.get("bits", 4)
    if bits != 4:
        raise _refuse(f"GPTQ with {bits} bits")
    fmt = config.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2") or config.get("is_marlin_format"):
        raise _refuse(f"GPTQ checkpoint_format {fmt!r} (only the gptq and gptq_v2 layouts)")
    if config.get("dynamic"):
        raise _refuse("GPTQ with per-module dynamic overrides")
    return Int4Checkpoint(
        "gptq", _group_size(config.get("group_size", 128)), symmetric=bool(config.get("sym", True)),
        act_order=bool(config.get("desc_act", False)), zero_offset=1 if fmt == "gptq" else 0,
    )  # fmt: skip


def is_int4_compressed_tensors(config: dict[str, Any]) -> bool:
    """Whether a compressed-tensors config quantizes its weights to integers (W4A16 and
    kin) rather than to FP8."""
    groups = config.get("config_groups") or {}
    return any((g.get("weights") or {}).get("type") == "int" for g in groups.values())


def compressed_tensors_checkpoint(config: dict[str, Any]) -> Int4Checkpoint:
    groups = config.get("config_groups") or {}
    schemes = set()
    for name, group in groups.items():
        weights = group.get("weights") or {}
        fmt = group.get("format") or config.get("format")
        if fmt != "pack-quantized":
            raise _refuse(f"compressed-tensors format {fmt!r} for integer weights")
        if (weights.get("type"), weights.get("num_bits")) != ("int", 4):
            raise _refuse(f"compressed-tensors group {name!r} weights of type "
                          f"{weights.get('type')!r} with {weights.get('num_bits')} bits")
        strategy = weights.get("strategy")
        if strategy not in ("group", "channel") or weights.get("dynamic"):
            raise _refuse(f"compressed-tensors int4 weight strategy {strategy!r}")
        if group.get("input_activations") or group.get("output_activations"):
            raise _refuse(f"compressed-tensors group {name!r} quantizes activations (only W4A16)")
        size = _group_size(weights.get("group_size")) if strategy == "group" else -1
        if strategy == "group" and size == -1:
            raise _refuse("compressed-tensors group strategy without a group_size")
        actorder = weights.get("actorder")
        if actorder not in (None, "group", "weight", "static", "dynamic"):
            raise _refuse(f"compressed-tensors actorder {actorder!r}")
        schemes.add((size, bool(weights.get("symmetric", True)), actorder == "group"))
    if config.get("kv_cache_scheme"):
        raise _refuse("compressed-tensors kv_cache_scheme")
    if len(schemes) != 1:
        raise _refuse("compressed-tensors int4 groups with different weight layouts")
    size, symmetric, act_order = schemes.pop()
    return Int4Checkpoint("compressed-tensors", size, symmetric=symmetric, act_order=act_order)


def split_group_error(name: str, k_full: int, world: int, group_size: int) -> str | None:
    """Why ``world`` ranks cannot split a row-parallel projection of ``k_full`` inputs
    into whole groups of ``group_size`` (None: they can)."""
    if world == 1 or group_size == -1 or (k_full % world == 0 and k_full // world % group_size == 0):
        return None
    return (
        f"{name}: tensor parallelism gives each rank {k_full // world} of its {k_full} input "
        f"features, not whole groups of the checkpoint's {group_size}; use a "
        f"tensor_parallel_size that divides its {-(-k_full // group_size)} group(s)"
    )


def check_tensor_parallel(scheme: Int4Checkpoint, row_parallel_inputs: dict[str, int],
                          world: int) -> None:  # fmt: skip
    """ValueError where ``world`` ranks would split a group of a row-parallel projection
    ({name: its input features}); act order keeps every group on every rank instead."""
    if scheme.act_order:
        return
    for name, k_full in row_parallel_inputs.items():
        error = split_group_error(name, k_full, world, scheme.group_size)
        if error:
            raise ValueError(error)
