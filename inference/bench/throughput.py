"""``pagoda bench throughput``: offline output tok/s over many token-id prompts, with an
optional transformers run of the same workload on the same device as the peer."""

from __future__ import annotations

import argparse
import time

from inference.bench.common import (
    add_engine_args,
    add_workload_args,
    bench_main,
    bench_model,
    copy_model_folder,
    engine_kwargs,
    install_copy_model,
    random_prompts,
    record,
    spec_decode_counts,
    spec_decode_line,
    spec_decode_summary,
    workload_input_len,
    workload_prompts,
    workload_summary,
    write_results,
)
from inference.model_shapes import resolve_shape_model


def add_throughput_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_engine_args(parser)
    add_workload_args(parser)
    parser.add_argument("--num-prompts", type=int, default=1024)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--peer", choices=["none", "transformers"], default="none",
                        help="also run transformers' generate on the same workload")
    parser.add_argument("--peer-num-prompts", type=int, default=64)
    return parser


def run_throughput(args: argparse.Namespace) -> int:
    from inference import LLM, SamplingParams

    folder, extra = resolve_shape_model(bench_model(args))
    copy_model_folder(args, folder, extra)
    t0 = time.perf_counter()
    llm = LLM(folder, **(extra | engine_kwargs(args, workload_input_len(args) + args.output_len)))
    startup_s = time.perf_counter() - t0
    engine = llm.engine
    install_copy_model(args, engine)
    prompts = workload_prompts(args, engine, args.num_prompts, args.input_len)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len,
                            detokenize=False)
    llm.generate(prompts[: min(8, len(prompts))], params, use_tqdm=False)  # warm-up
    spec_before = spec_decode_counts(engine)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    num_in = sum(map(len, prompts))
    result = record(
        "throughput",
        model=args.model,
        tensor_parallel_size=engine.config.tensor_parallel_size,
        quantization=engine.config.quantization,
        num_prompts=args.num_prompts,
        input_len=round(num_in / len(prompts)),
        output_len=args.output_len,
        elapsed_s=round(elapsed, 3),
        output_tok_s=round(num_out / elapsed, 1),
        total_tok_s=round((num_out + num_in) / elapsed, 1),
        requests_s=round(args.num_prompts / elapsed, 2),
        startup_s=round(startup_s, 1),
        kv_cache_tokens=engine.num_total_blocks * engine.config.block_size,
        kv_cache_dtype=engine.config.kv_cache_dtype,
        engine="pagoda",
        **workload_summary(args, prompts, outs),
        **spec_decode_summary(engine, spec_before),
    )
    print(f"pagoda   {args.model}: {args.num_prompts} x {result['input_len']}/{args.output_len}: "
          f"{result['output_tok_s']:.0f} output tok/s ({elapsed:.2f} s), "
          f"KV {result['kv_cache_tokens']} tokens, start {startup_s:.1f} s"
          + (f", copy rate {100 * result['copy_rate']:.0f} %" if "copy_rate" in result else ""))
    if "mean_acceptance_length" in result:
        print(spec_decode_line(result))
    results = [result]
    if args.peer == "transformers":
        del llm, engine
        results.append(_transformers_peer(args, folder))
    write_results(args, results if len(results) > 1 else result)
    return 0


def _transformers_peer(args: argparse.Namespace, folder: str) -> dict:
    """transformers' generate, padded static batches, same shape and dtype."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = AutoConfig.from_pretrained(folder)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    n = args.peer_num_prompts
    prompts = torch.tensor(random_prompts(n, args.input_len, config.vocab_size), device=device)
    kwargs = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                  do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(prompts[:2], attention_mask=torch.ones_like(prompts[:2]), **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(prompts, attention_mask=torch.ones_like(prompts), **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    out_tok_s = n * args.output_len / elapsed
    print(f"transformers {args.model}: {n} x {args.input_len}/{args.output_len} in one batch: "
          f"{out_tok_s:.0f} output tok/s ({elapsed:.2f} s)")
    return record("throughput", model=args.model, num_prompts=n, input_len=args.input_len,
                  output_len=args.output_len, elapsed_s=round(elapsed, 3),
                  output_tok_s=round(out_tok_s, 1),
                  total_tok_s=round(n * (args.input_len + args.output_len) / elapsed, 1),
                  engine="transformers")



if __name__ == "__main__":
    raise SystemExit(bench_main(add_throughput_args, run_throughput, "pagoda bench throughput"))
