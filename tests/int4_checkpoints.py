"""Tiny 4-bit checkpoints in the published layouts, and what they mean.

``write_int4_checkpoint`` quantizes a full-precision model folder's projections
round-to-nearest (per group of input features, or per channel; asymmetric or symmetric;
GPTQ's act order as a random permutation of the groups shared by the projections of one
input) and writes them as AutoAWQ GEMM, GPTQ (v1 or v2 zero points) or compressed-tensors
``pack-quantized`` does. ``decode_checkpoint`` reads the written tensors back by each
format's own definition (the bit orders spelled out here, independently of the engine's
loader) into the float32 weights the checkpoint means, for transformers to run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column of the word's eight held by nibble i
# layout -> (format, symmetric, act order, GPTQ zero-point offset)
LAYOUTS = {
    "awq": ("awq", False, False, 0),
    "gptq-sym": ("gptq", True, False, 1),
    "gptq-asym": ("gptq", False, False, 1),
    "gptq-sym-actorder": ("gptq", True, True, 1),
    "gptq-asym-actorder": ("gptq", False, True, 1),
    "gptq-v2-asym": ("gptq", False, False, 0),
    "ct-sym": ("compressed-tensors", True, False, 0),
    "ct-asym": ("compressed-tensors", False, False, 0),
    "ct-actorder": ("compressed-tensors", True, True, 0),
}


def groups_of(k: int, group_size: int, act_order: bool, seed: int) -> torch.Tensor:
    """The group of every input feature: k // group_size, permuted under act order."""
    plain = torch.arange(k) // group_size
    if not act_order:
        return plain
    return plain[torch.randperm(k, generator=torch.Generator().manual_seed(seed))]


def quantize_rtn(weight: torch.Tensor, groups: torch.Tensor, symmetric: bool,
                 zero_range: tuple[int, int] = (0, 15)):  # fmt: skip
    """Round to nearest: (codes [N, K] 0..15, fp16 scales [N, G], zeros [N, G])."""
    w = weight.float()
    index = groups[None, :].expand_as(w)
    shape = (w.shape[0], int(groups.max()) + 1)

    def reduce(values: torch.Tensor, how: str) -> torch.Tensor:
        return torch.zeros(shape).scatter_reduce(1, index, values, how, include_self=False)

    if symmetric:
        scales = (reduce(w.abs(), "amax") * 2 / 15).clamp_min(1e-8)
        zeros = torch.full(shape, 8, dtype=torch.int64)
    else:
        low, high = reduce(w, "amin").clamp(max=0), reduce(w, "amax").clamp(min=0)
        scales = ((high - low) / 15).clamp_min(1e-8)
        zeros = (-low / scales).round().clamp(*zero_range).long()
    scales = scales.half()
    codes = (w / scales.float()[:, groups]).round() + zeros[:, groups]
    return codes.clamp(0, 15).long(), scales, zeros


def pack_along_last(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """int [R, C] (C a multiple of 8) -> int32 [R, C / 8]: nibble i of word c holds
    column 8 c + order[i]."""
    words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for i, column in enumerate(order):
        words |= (values[:, column::8].long() & 0xF) << (4 * i)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_along_last(words: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    values = torch.zeros(words.shape[0], words.shape[1] * 8, dtype=torch.int64)
    for i, column in enumerate(order):
        values[:, column::8] = (words.long() >> (4 * i)) & 0xF
    return values


def pack_projection(fmt: str, codes, scales, zeros, groups, offset: int) -> dict:
    """The tensors ``fmt`` stores for one projection, by suffix."""
    if fmt == "awq":  # [K, N / 8] words along N, interleaved; fp16 scales [G, N]
        return {"qweight": pack_along_last(codes.T, AWQ_ORDER),
                "qzeros": pack_along_last(zeros.T, AWQ_ORDER), "scales": scales.T.contiguous()}
    if fmt == "gptq":  # [K / 8, N] words along K; zeros along N, stored minus the offset
        return {"qweight": pack_along_last(codes).T.contiguous(),
                "qzeros": pack_along_last(zeros.T - offset), "scales": scales.T.contiguous(),
                "g_idx": groups.to(torch.int32)}  # fmt: skip
    out = {"weight_packed": pack_along_last(codes), "weight_scale": scales,
           "weight_shape": torch.tensor(list(codes.shape))}  # fmt: skip
    if not (zeros == 8).all():  # signed zero point + 8, packed along N
        out["weight_zero_point"] = pack_along_last(zeros.T).T.contiguous()
    if not torch.equal(groups, torch.arange(codes.shape[1]) // groups.bincount()[0]):
        out["weight_g_idx"] = groups.to(torch.int32)
    return out


def decode_projection(fmt: str, t: dict, offset: int, group_size: int) -> torch.Tensor:
    """The float32 [N, K] weight a projection's stored tensors mean, by the format
    (``group_size`` as its config says; -1: per channel)."""
    if fmt == "awq":
        codes = unpack_along_last(t["qweight"], AWQ_ORDER).T
        zeros = unpack_along_last(t["qzeros"], AWQ_ORDER).T
        scales = t["scales"].float().T
        groups = torch.arange(codes.shape[1]) // (codes.shape[1] if group_size == -1 else group_size)
    elif fmt == "gptq":
        codes = unpack_along_last(t["qweight"].T.contiguous())
        zeros = unpack_along_last(t["qzeros"]).T + offset
        scales, groups = t["scales"].float().T, t["g_idx"].long()
    else:
        n, k = t["weight_shape"].tolist()
        codes = unpack_along_last(t["weight_packed"])[:, :k]
        zp = t.get("weight_zero_point")
        scales = t["weight_scale"].float()
        zeros = torch.full(scales.shape, 8) if zp is None else unpack_along_last(
            zp.T.contiguous()).T[:n]  # fmt: skip
        groups = t.get("weight_g_idx")
        groups = (torch.arange(k) // (k if group_size == -1 else group_size) if groups is None
                  else groups.long())  # fmt: skip
    return (codes - zeros[:, groups]).float() * scales[:, groups]


def _group_seed(name: str) -> int:
    """Projections of one input share an act order: q/k/v, gate/up."""
    layer = int(name.split(".")[2])
    family = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2,
              "up_proj": 2, "down_proj": 3}[name.split(".")[-2]]  # fmt: skip
    return 4 * layer + family


def is_projection(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS


def write_int4_checkpoint(source: Path, target: Path, layout: str,
                          group_size: int = 32) -> dict[str, torch.Tensor]:  # fmt: skip
    """Copy the model folder ``source`` to ``target`` with its projections in ``layout``
    (a key of LAYOUTS; ``group_size`` -1: per channel); returns each projection's
    weight as the written checkpoint means it (``decode_checkpoint``)."""
    fmt, symmetric, act_order, offset = LAYOUTS[layout]
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"))
    (source_file,) = source.glob("*.safetensors")
    weights_file = target / source_file.name
    out = {}
    for name, tensor in load_file(source_file).items():
        if not is_projection(name):
            out[name] = tensor
            continue
        k = tensor.shape[1]
        size = k if group_size == -1 else group_size
        groups = groups_of(k, size, act_order, _group_seed(name))
        zero_range = (1, 15) if offset else (0, 15)  # v1 cannot store zero 0
        codes, scales, zeros = quantize_rtn(tensor, groups, symmetric, zero_range)
        prefix = name[: -len("weight")]
        for suffix, value in pack_projection(fmt, codes, scales, zeros, groups, offset).items():
            out[prefix + suffix] = value
    save_file(out, str(weights_file), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = quantization_config(layout, group_size)
    (target / "config.json").write_text(json.dumps(config))
    return decode_checkpoint(target)


def quantization_config(layout: str, group_size: int) -> dict:
    fmt, symmetric, act_order, offset = LAYOUTS[layout]
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}  # fmt: skip
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "sym": symmetric,
                "desc_act": act_order, "damp_percent": 0.01, "static_groups": False,
                "true_sequential": True, "lm_head": False,
                "checkpoint_format": "gptq" if offset else "gptq_v2"}  # fmt: skip
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "dynamic": False,
               "strategy": "channel" if group_size == -1 else "group",
               "group_size": None if group_size == -1 else group_size,
               "actorder": "group" if act_order else None, "observer": "minmax"}  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None,
                                          "output_activations": None}}}  # fmt: skip


def decode_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """{``<prefix>.weight``: float32 weight} of every packed projection in ``folder``."""
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    fmt = config["quant_method"]
    if fmt == "compressed-tensors":
        weights = config["config_groups"]["group_0"]["weights"]
        group_size = weights["group_size"] if weights["strategy"] == "group" else -1
    else:
        group_size = config["group_size"]
    offset = 1 if fmt == "gptq" and config.get("checkpoint_format", "gptq") == "gptq" else 0
    (weights_file,) = folder.glob("*.safetensors")
    tensors = load_file(weights_file)
    packed = "weight_packed" if fmt == "compressed-tensors" else "qweight"
    meant = {}
    for name in tensors:
        if name.endswith("." + packed):
            prefix = name[: -len(packed)]
            mine = {n[len(prefix):]: t for n, t in tensors.items()
                    if n.startswith(prefix) and "." not in n[len(prefix):]}  # fmt: skip
            meant[prefix + "weight"] = decode_projection(fmt, mine, offset, group_size)
    return meant


def dequantized_folder(source: Path, meant: dict[str, torch.Tensor], target: Path) -> Path:
    """``source`` (the full-precision folder) with its projections replaced by ``meant``:
    a plain checkpoint transformers (or the engine, unquantized) runs."""
    shutil.copytree(source, target)
    (weights_file,) = target.glob("*.safetensors")
    tensors = load_file(weights_file)
    for name, weight in meant.items():
        tensors[name] = weight.to(tensors[name].dtype).contiguous()
    save_file(tensors, str(weights_file), metadata={"format": "pt"})
    return target
