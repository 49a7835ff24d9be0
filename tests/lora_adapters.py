"""Random PEFT LoRA adapters for a tiny model, and the model with one merged into it.

An adapter folder is what PEFT saves (``adapter_config.json`` + ``adapter_model.safetensors``,
keys ``base_model.model.model.layers.N.<self_attn|mlp>.<proj>.lora_<A|B>.weight``), with
random non-zero A and B (PEFT starts B at zero, which would test nothing). ``merged_model``
is the Hugging Face model with ``W + scale * B @ A`` in every adapted projection: the
ground truth the engine's batched LoRA must reproduce."""

from __future__ import annotations

import contextlib
import copy
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _projection(hf_model, layer: int, module: str):
    block = hf_model.model.layers[layer]
    return getattr(block.self_attn if module in ATTENTION else block.mlp, module)


def build_adapter(
    folder: Path, hf_model, rank: int, targets=ATTENTION + MLP, alpha: float = 16.0,
    rslora: bool = False, seed: int = 0, layers: list[int] | None = None, **config_extra,
) -> dict:
    """Write a random adapter for ``hf_model`` into ``folder``; returns its tensors (PEFT
    names -> tensor) and scale under keys ``tensors`` and ``scale``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    layer_ids = range(len(hf_model.model.layers)) if layers is None else layers
    for layer in layer_ids:
        for module in targets:
            proj = _projection(hf_model, layer, module)
            out, inp = proj.weight.shape
            group = "self_attn" if module in ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=g) / inp**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.6 / rank**0.5
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": rslora,
              "target_modules": list(targets), "bias": "none", **config_extra}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    return {"tensors": tensors, "scale": scale}


@torch.no_grad()
def merged_model(hf_model, adapter: dict):
    """A copy of ``hf_model`` with the adapter merged: W + scale * B @ A."""
    merged = copy.deepcopy(hf_model)
    _merge(merged, adapter)
    return merged


@contextlib.contextmanager
def merged_into(hf_model, adapter: dict):
    """``hf_model`` itself with the adapter merged, for the block; its weights are put back
    after (no copy of a model too large to copy cheaply)."""
    saved = {name: p.detach().clone() for name, p in hf_model.named_parameters()
             if name.endswith("proj.weight")}  # fmt: skip
    _merge(hf_model, adapter)
    try:
        yield hf_model
    finally:
        with torch.no_grad():
            for name, p in hf_model.named_parameters():
                if name in saved:
                    p.copy_(saved[name])


@torch.no_grad()
def _merge(merged, adapter: dict) -> None:
    for key, a in adapter["tensors"].items():
        if ".lora_A." not in key:
            continue
        b = adapter["tensors"][key.replace(".lora_A.", ".lora_B.")]
        parts = key.split(".")
        layer, module = int(parts[4]), parts[6]
        weight = _projection(merged, layer, module).weight
        weight += (adapter["scale"] * (b.double() @ a.double())).to(weight.dtype)
