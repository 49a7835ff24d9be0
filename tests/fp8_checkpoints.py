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


ROW_PARALLEL = ("o_proj", "down_proj")


def held_weights(meant: dict[str, torch.Tensor], world: int = 1,
                 requantize: bool = True) -> dict[str, torch.Tensor]:  # fmt: skip
    """The dequantized weights a ``world``-rank engine holds for a checkpoint that means
    ``meant``: requantized per channel (online or block-wise: row-parallel projections per
    rank's columns), or as stored (per-channel / per-tensor checkpoints)."""
    if not requantize:
        return dict(meant)
    held = {}
    for name, weight in meant.items():
        chunks = weight.chunk(world, dim=1) if name.split(".")[-2] in ROW_PARALLEL else [weight]
        held[name] = torch.cat([dequantize(*per_channel(c)) for c in chunks], dim=1)
    return held


def fake_quantized_reference(hf_model, weights: dict[str, torch.Tensor], world: int = 1):
    """``hf_model`` (float32) with ``weights`` copied in and every projection's input
    rounded per token to e4m3 (scale amax / 448, floored at 1 / (448 * 512)); the inputs of
    row-parallel projections per rank's share of the columns, as ``world`` ranks do."""

    def quantize(x: torch.Tensor) -> torch.Tensor:
        scale = (x.abs().amax(dim=-1, keepdim=True) / 448.0).clamp_min(1.0 / (448.0 * 512.0))
        return ((x / scale).clamp(-448.0, 448.0).to(FP8).float() * scale).to(x.dtype)

    def quantize_input(module, args):  # type: ignore[no-untyped-def]
        return (quantize(args[0]),)

    def quantize_shards(module, args):  # type: ignore[no-untyped-def]
        return (torch.cat([quantize(c) for c in args[0].chunk(world, dim=-1)], dim=-1),)

    with torch.no_grad():
        for name, module in hf_model.named_modules():
            kind = name.split(".")[-1]
            if kind in PROJECTIONS:
                module.weight.copy_(weights[name + ".weight"])
                sharded = kind in ROW_PARALLEL and world > 1
                module.register_forward_pre_hook(quantize_shards if sharded else quantize_input)
    return hf_model


@torch.no_grad()
def prompt_logprobs_of(hf_model, prompt: list[int]) -> torch.Tensor:
    """log p(prompt[i] | prompt[:i]) for i >= 1, teacher-forced."""
    logprobs = hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    return logprobs[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


PROMPTS = [[(7 * i + 3 * j) % 300 + 3 for i in range(n)] for j, n in enumerate((40, 17, 64))]
ENGINE = dict(device="cpu", max_model_len=128, block_size=16, max_num_batched_tokens=32)
# The engine computes the scheme in float32 like the reference, but sums in another order:
# most positions agree to float32 rounding; now and then an activation lands on the other
# side of an fp8 rounding boundary, which sharp attention amplifies at a few positions
# (up to ~0.1 measured). A wrong scale or shard moves every position by tenths.
EXACT, MIN_EXACT_SHARE, MEAN_TOL = 1e-4, 0.8, 1e-2


def engine_prompt_logprobs(folder: Path, **kwargs) -> list[torch.Tensor]:
    """The engine's log p(prompt[i] | prompt[:i]) for every prompt of PROMPTS."""
    from inference import LLM, SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    with LLM(str(folder), **(ENGINE | kwargs)) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [
        torch.tensor([entry[t].logprob for entry, t in zip(o.prompt_logprobs[1:], p[1:],
                                                            strict=True)])  # fmt: skip
        for o, p in zip(outs, PROMPTS, strict=True)
    ]


def reference_prompt_logprobs(folder: Path, weights: dict[str, torch.Tensor], world: int = 1):
    """transformers' (``fake_quantized_reference``) for every prompt of PROMPTS."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf = fake_quantized_reference(hf, weights, world)
    return [prompt_logprobs_of(hf, p) for p in PROMPTS]


def differences(engine, reference) -> tuple[float, float]:
    """(mean |difference|, share of positions within EXACT)."""
    diff = torch.cat([(e - r).abs() for e, r in zip(engine, reference, strict=True)])
    return diff.mean().item(), (diff <= EXACT).float().mean().item()


def check(engine, reference) -> float:
    mean, share = differences(engine, reference)
    assert mean <= MEAN_TOL and share >= MIN_EXACT_SHARE, (mean, share)
    return mean


def original_projections(folder: Path) -> dict[str, torch.Tensor]:
    (file,) = folder.glob("*.safetensors")
    return {n: t for n, t in load_file(file).items() if is_projection(n)}
