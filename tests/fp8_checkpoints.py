"""Tiny FP8 checkpoints in the published layouts, and transformers as their reference.

``write_fp8_checkpoint`` turns a tiny full-precision model folder (``tiny_models``) into
one of the layouts the engine loads: Hugging Face ``quant_method: "fp8"`` with block-wise
``weight_scale_inv`` (as the Qwen FP8 releases), or ``compressed-tensors`` with per-channel
or per-tensor ``weight_scale`` (the "FP8-dynamic" releases). ``fake_quantized_reference``
is transformers' float32 model with the projection weights the engine should hold, and
each projection's input rounded per token to e4m3 as the engine's W8A8 scheme does: the
exact math of the scheme in float32, from an independent implementation.

Written here, not with the engine's code: the quantizers are a few lines each.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = weight.float().abs().amax(dim=1, keepdim=True) / 448.0
    return (weight.float() / scale).to(FP8), scale


def per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = weight.float().abs().amax().reshape(1) / 448.0
    return (weight.float() / scale).to(FP8), scale


def block_wise(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = weight.shape
    br, bc = block
    nbr, nbc = -(-rows // br), -(-cols // bc)
    scale = torch.zeros(nbr, nbc)
    for i in range(nbr):
        for j in range(nbc):
            scale[i, j] = weight[i * br : (i + 1) * br, j * bc : (j + 1) * bc].abs().max() / 448.0
    elementwise = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return (weight.float() / elementwise).to(FP8), scale


def dequantize(quantized: torch.Tensor, scale: torch.Tensor, block=None) -> torch.Tensor:
    if block is not None:
        rows, cols = quantized.shape
        scale = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)
        scale = scale[:, :cols]
    return quantized.float() * scale


def is_projection(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS


def write_fp8_checkpoint(source: Path, target: Path, layout: str,
                         block: tuple[int, int] = (32, 48)) -> dict[str, torch.Tensor]:  # fmt: skip
    """Copy the model folder ``source`` to ``target`` with its projections in ``layout``
    ("hf-block", "ct-channel" or "ct-tensor"); returns each projection's dequantized
    weight (what the checkpoint means) by name."""
    shutil.copytree(source, target)
    (weights_file,) = target.glob("*.safetensors")
    tensors = load_file(weights_file)
    out, meant = {}, {}
    for name, tensor in tensors.items():
        if not is_projection(name):
            out[name] = tensor
            continue
        if layout == "hf-block":
            quantized, scale = block_wise(tensor, block)
            out[name + "_scale_inv"] = scale
            meant[name] = dequantize(quantized, scale, block)
        else:
            quantized, scale = (per_channel if layout == "ct-channel" else per_tensor)(tensor)
            out[name + "_scale"] = scale.to(torch.bfloat16 if layout == "ct-channel" else
                                            torch.float32)  # fmt: skip
            meant[name] = quantized.float() * out[name + "_scale"].float()
        out[name] = quantized
    save_file(out, str(weights_file), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    if layout == "hf-block":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                         "activation_scheme": "dynamic",
                                         "weight_block_size": list(block)}  # fmt: skip
    else:
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                            "strategy": layout.removeprefix("ct-")},
                "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                      "dynamic": True, "strategy": "token"},
            }},
        }  # fmt: skip
    (target / "config.json").write_text(json.dumps(config))
    return meant


def fake_quantized_reference(hf_model, weights: dict[str, torch.Tensor]):
    """``hf_model`` (float32) with ``weights`` copied in and every projection's input
    rounded per token to e4m3 (scale amax / 448, floored at 1 / (448 * 512))."""

    def quantize_input(module, args):  # type: ignore[no-untyped-def]
        (x,) = args
        scale = (x.abs().amax(dim=-1, keepdim=True) / 448.0).clamp_min(1.0 / (448.0 * 512.0))
        return ((x / scale).clamp(-448.0, 448.0).to(FP8).float() * scale,)

    with torch.no_grad():
        for name, module in hf_model.named_modules():
            if name.split(".")[-1] in PROJECTIONS:
                module.weight.copy_(weights[name + ".weight"])
                module.register_forward_pre_hook(quantize_input)
    return hf_model


@torch.no_grad()
def prompt_logprobs_of(hf_model, prompt: list[int]) -> torch.Tensor:
    """log p(prompt[i] | prompt[:i]) for i >= 1, teacher-forced."""
    logprobs = hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    return logprobs[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
