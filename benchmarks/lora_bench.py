"""Multi-LoRA speed against the base model, one engine call pattern for both (the issue's
targets: decode at batch 64 with 8 distinct rank-16 adapters <= 1.25x the base step time,
batch 1 with one adapter <= 1.15x, prefill throughput with adapters >= 0.85x).

``python -m benchmarks.lora_bench --model qwen2.5-1.5b`` builds the named shape with
random weights and one random rank-16 adapter of every projection (served under 8 ids: 8
distinct device slots), then times decode steps and a prefill, base versus adapters.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from inference import SamplingParams
from inference.config import EngineConfig
from inference.llm_engine import LLMEngine
from inference.lora.peft import module_shapes
from inference.lora.request import LoRARequest
from inference.model_shapes import resolve_shape_model
from inference.models.config import ModelConfig


def write_random_adapter(folder: Path, cfg: ModelConfig, rank: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module, (out, inp) in module_shapes(cfg).items():
            group = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{group}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, dtype=torch.bfloat16) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, dtype=torch.bfloat16) * 0.02
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
         "target_modules": list(module_shapes(cfg))}))  # fmt: skip


def _drain(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def decode_step_ms(engine: LLMEngine, loras: list, batch: int, steps: int) -> float:
    """Mean step time of ``steps`` decode steps of ``batch`` sequences (row i runs with
    ``loras[i % len(loras)]``), after their prefill."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 40, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{time.monotonic_ns()}-{i}", [(7 * i + j) % 1000 + 5
                                                         for j in range(64)], params,
                           lora_request=loras[i % len(loras)])  # fmt: skip
    for _ in range(20):  # prefill and settle into decode
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    _drain(engine)
    return 1e3 * elapsed / steps


def prefill_tokens_per_s(engine: LLMEngine, loras: list, prompts: int, length: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(prompts):
        engine.add_request(f"p{time.monotonic_ns()}-{i}", [(11 * i + j) % 1000 + 5
                                                         for j in range(length)], params,
                           lora_request=loras[i % len(loras)])  # fmt: skip
    _drain(engine)
    torch.cuda.synchronize()
    return prompts * length / (time.perf_counter() - start)


def measure(model: str, rank: int, num_adapters: int, steps: int) -> dict:
    folder, extra = resolve_shape_model(model)
    cfg = ModelConfig.from_folder(folder)
    adapter = Path(tempfile.mkdtemp(prefix="pagoda-lora-bench-")) / "adapter"
    write_random_adapter(adapter, cfg, rank)
    loras = [LoRARequest(f"a{i}", i + 1, str(adapter)) for i in range(num_adapters)]
    common = dict(load_format=extra.get("load_format", "auto"), dtype="bfloat16",
                  max_model_len=4096, enable_prefix_caching=False)  # fmt: skip
    results = {}
    for name, lora_args in (("base", {}), ("lora", dict(enable_lora=True, max_loras=num_adapters,
                                                         max_lora_rank=rank))):
        engine = LLMEngine(EngineConfig.from_kwargs(folder, **common, **lora_args))
        runs = [[None]] if name == "base" else [[None], loras, loras[:1]]
        for which in runs:
            label = name if which == [None] else f"{name}-{len(which)}-adapters"
            results[f"{label}/decode_b64_ms"] = decode_step_ms(engine, which, 64, steps)
            results[f"{label}/decode_b1_ms"] = decode_step_ms(engine, which[:1], 1, steps)
            results[f"{label}/prefill_tok_s"] = prefill_tokens_per_s(engine, which, 16, 1024)
        engine.shutdown()
    base = results
    ratios = {
        "decode_b64_8_adapters_vs_base": base[f"lora-{num_adapters}-adapters/decode_b64_ms"]
        / base["base/decode_b64_ms"],
        "decode_b1_1_adapter_vs_base": base["lora-1-adapters/decode_b1_ms"]
        / base["base/decode_b1_ms"],
        "prefill_with_adapters_vs_base": base[f"lora-{num_adapters}-adapters/prefill_tok_s"]
        / base["base/prefill_tok_s"],
    }
    return {"model": model, "rank": rank, "adapters": num_adapters,
            "device": torch.cuda.get_device_name(), "results": results, "ratios": ratios}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-1.5b")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.model, args.rank, args.adapters, args.steps), indent=2))


if __name__ == "__main__":
    main()
