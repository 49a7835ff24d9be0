"""A PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``),
checked against the base model and read into float32 tensors.

What serves: LoRA on any of the attention and MLP projections (q/k/v/o, gate/up/down), one
rank ``r`` up to ``max_lora_rank``, scaled by ``lora_alpha / r`` (rsLoRA:
``lora_alpha / sqrt(r)``). Everything else is refused with a sentence that says what and
why, before any request runs with it: DoRA, adapters (or fully trained copies) of the
embedding or LM head, trained biases, per-module ranks, a rank above the maximum, modules
this model does not have, and tensors whose shapes do not fit the base model.

``check_adapter_files`` checks what needs no base model (config, tensor names);
``inspect_adapter`` checks a folder from its config and the safetensors header alone (no
tensor is read, and no torch is imported: the server checks an adapter it is asked to load
with it, and the engine each adapter a request names); ``load_adapter`` reads the tensors,
with the scale folded into B.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from inference.models.config import ModelConfig

if TYPE_CHECKING:
    import torch

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (and without "model.").
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\."
    r"lora_([AB])(?:\.[\w-]+)?\.weight$"
)


class AdapterError(ValueError):
    """An adapter folder this engine cannot serve (the message says why)."""


@dataclass(frozen=True)
class AdapterInfo:
    """What ``inspect_adapter`` found: the adapter's rank, scale and the (layer, module)
    pairs it adapts."""

    path: Path
    rank: int
    scale: float
    modules: tuple[tuple[int, str], ...]


@dataclass
class PeftAdapter:
    """An adapter's tensors in float32 on the CPU: ``(layer, module) -> (A [r, in],
    B [out, r] * scale)``."""

    info: AdapterInfo
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each adaptable projection of the (unsharded) base model."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}  # fmt: skip


def _read_config(folder: Path) -> dict:
    if not folder.is_dir():
        raise AdapterError(f"LoRA adapter folder {folder} does not exist")
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"{folder} has no {CONFIG_FILE}: not a PEFT adapter folder")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{path} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path} must hold a JSON object")
    return config


def _check_config(config: dict, folder: Path, max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scale; AdapterError for what is not served."""
    kind = str(config.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise AdapterError(f"{folder}: peft_type {kind} is not supported (LoRA adapters only)")
    if config.get("use_dora"):
        raise AdapterError(f"{folder}: DoRA adapters (use_dora) are not supported")
    if config.get("modules_to_save"):
        raise AdapterError(
            f"{folder}: modules_to_save {config['modules_to_save']} are not supported: only "
            "LoRA updates of the attention and MLP projections are served")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{folder}: trained biases (bias={config['bias']!r}) are not "
                           "supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterError(f"{folder}: per-module ranks (rank_pattern, alpha_pattern) are "
                           "not supported: one rank for every module")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{folder}: rank r must be a positive int, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{folder}: rank {rank} exceeds --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"{folder}: lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    targets = config.get("target_modules") or []
    names = [targets] if isinstance(targets, str) else list(targets)
    for name in names:
        leaf = name.split(".")[-1]
        if leaf in ("embed_tokens", "lm_head"):
            raise AdapterError(f"{folder}: adapters of {leaf} are not supported (the "
                               "embedding and the LM head stay the base model's)")
    return rank, float(scale)


def _tensor_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        other = " (adapter_model.bin is not read: convert it to safetensors)" if (
            folder / "adapter_model.bin").is_file() else ""  # fmt: skip
        raise AdapterError(f"{folder} has no {WEIGHTS_FILE}{other}")
    # The safetensors format: an 8-byte little-endian header length, then a JSON header
    # naming each tensor's dtype, shape and offsets (and an optional __metadata__).
    try:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= 100 * 2**20:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{path} is not a safetensors file: {exc}") from None
    return {key: tuple(entry["shape"]) for key, entry in header.items()
            if key != "__metadata__"}  # fmt: skip


def _parse_key(key: str, folder: Path) -> tuple[int, str, str]:
    if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
        raise AdapterError(f"{folder}: {key}: adapters of the embedding or the LM head are "
                           "not supported")
    if "lora_magnitude_vector" in key:
        raise AdapterError(f"{folder}: {key}: DoRA adapters are not supported")
    match = _KEY.match(key)
    if match is None:
        raise AdapterError(f"{folder}: tensor {key} is not a LoRA update of a q/k/v/o/gate/"
                           "up/down projection")
    layer, _, module, which = match.groups()
    if module not in SUPPORTED_MODULES:
        raise AdapterError(f"{folder}: {key}: module {module} is not supported (only "
                           f"{', '.join(SUPPORTED_MODULES)})")
    return int(layer), module, which


def check_adapter_files(path: str | Path, max_rank: int) -> int:
    """The adapter's rank, from what the folder alone says (no base model): its config and
    the names of its tensors. AdapterError for what no base model could serve; the shapes
    are checked against the model by ``inspect_adapter``. ``pagoda download --lora-max-rank``
    runs this, so a bad adapter fails its download rather than every engine's start."""
    folder = Path(path)
    rank, _ = _check_config(_read_config(folder), folder, max_rank)
    keys = list(_tensor_shapes(folder))
    for key in keys:
        _parse_key(key, folder)
    if not keys:
        raise AdapterError(f"{folder}: {WEIGHTS_FILE} holds no LoRA tensors")
    return rank


def inspect_adapter(path: str | Path, cfg: ModelConfig, max_rank: int) -> AdapterInfo:
    """Check a folder from its config and tensor shapes (AdapterError says what is wrong)."""
    folder = Path(path)
    rank, scale = _check_config(_read_config(folder), folder, max_rank)
    shapes = module_shapes(cfg)
    found: dict[tuple[int, str], set[str]] = {}
    for key, shape in _tensor_shapes(folder).items():
        layer, module, which = _parse_key(key, folder)
        if layer >= cfg.num_layers:
            raise AdapterError(f"{folder}: {key}: the base model has {cfg.num_layers} layers")
        out, inp = shapes[module]
        want = (rank, inp) if which == "A" else (out, rank)
        if shape != want:
            raise AdapterError(f"{folder}: {key} has shape {list(shape)}, expected "
                               f"{list(want)} for this base model at rank {rank}")
        found.setdefault((layer, module), set()).add(which)
    incomplete = [f"layers.{i}.{m}" for (i, m), ab in found.items() if ab != {"A", "B"}]
    if incomplete:
        raise AdapterError(f"{folder}: {incomplete[0]} has lora_A or lora_B but not both")
    if not found:
        raise AdapterError(f"{folder}: {WEIGHTS_FILE} holds no LoRA tensors")
    return AdapterInfo(folder, rank, scale, tuple(sorted(found)))


def load_adapter(path: str | Path, cfg: ModelConfig, max_rank: int) -> PeftAdapter:
    """The adapter's tensors (float32, CPU), checked as ``inspect_adapter`` does."""
    from safetensors import safe_open

    info = inspect_adapter(path, cfg, max_rank)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(info.path / WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():
            layer, module, which = _parse_key(key, info.path)
            parts.setdefault((layer, module), {})[which] = f.get_tensor(key).float()
    weights = {key: (ab["A"], ab["B"] * info.scale) for key, ab in parts.items()}
    return PeftAdapter(info, weights)
