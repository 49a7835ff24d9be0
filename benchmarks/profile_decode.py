"""Where a decode step's time goes: torch.profiler over a short generation, kernels ranked
by GPU time, plus the GPU-busy fraction of the wall time.

    python -m benchmarks.profile_decode --model qwen2.5-1.5b --batch-size 1
"""

from __future__ import annotations

import argparse
import sys
import time

from inference.bench.common import random_prompts
from inference.model_shapes import resolve_shape_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="profile_decode")
    parser.add_argument("--model", default="qwen2.5-1.5b")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--quantization", choices=["fp8"], default=None)
    args = parser.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from inference import LLM, SamplingParams

    folder, extra = resolve_shape_model(args.model)
    llm = LLM(folder, max_model_len=args.input_len + args.output_len,
              max_num_seqs=max(args.batch_size, 8), quantization=args.quantization, **extra)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.output_len,
                            detokenize=False)
    llm.generate(random_prompts(args.batch_size, args.input_len, vocab, 1), params,
                 use_tqdm=False)
    prompts = random_prompts(args.batch_size, args.input_len, vocab, 2)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    gpu_total_us = sum(e.self_device_time_total for e in events)
    print(f"{args.model} batch {args.batch_size}: {args.output_len} tokens in "
          f"{wall * 1e3:.1f} ms ({wall / args.output_len * 1e3:.3f} ms/step); GPU busy "
          f"{gpu_total_us / 1e3:.1f} ms ({gpu_total_us / 1e6 / wall:.0%} of wall)")
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    print(f"{'GPU us':>10} {'calls':>7} {'us/call':>8}  kernel")
    for e in events[: args.top]:
        per_call = e.self_device_time_total / max(e.count, 1)
        print(f"{e.self_device_time_total:10.0f} {e.count:7d} {per_call:8.1f}  {e.key[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
