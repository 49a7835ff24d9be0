"""``pagoda bench latency``: a batch of B requests at once; end-to-end latency, time to
first token and time per output token, for each batch size, prompt length and output length
asked for.

Long context is a sweep of prompt lengths: ``--input-len 8192 32768 --batch-size 1 16
--output-len 64`` gives the time to first token of 8k and 32k prompts (prefill attention)
and the time per output token at those contexts (decode attention); ``--block-size`` picks
the KV block size it runs with."""

from __future__ import annotations

import argparse
import statistics
import time

from inference.bench.common import (
    add_engine_args,
    add_workload_args,
    bench_main,
    bench_model,
    copy_model_folder,
    engine_kwargs,
    install_copy_model,
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


def _measure(llm, args, batch: int, input_len: int, output_len: int) -> dict:
    from inference import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len,
                            detokenize=False)
    llm.generate(workload_prompts(args, engine, batch, input_len, seed=batch), params,
                 use_tqdm=False)
    runs, all_prompts, all_outputs = [], [], []
    spec_before = spec_decode_counts(engine)
    for it in range(args.num_iters):
        # Fresh prompts each iteration: the prefix cache must not make later runs free.
        prompts = workload_prompts(args, engine, batch, input_len, seed=1000 * batch + it)
        start = time.perf_counter()
        wall0 = time.time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        ttft = statistics.mean(o.metrics.first_token_time - wall0 for o in outs)
        runs.append((elapsed, ttft))
        all_prompts += prompts
        all_outputs += outs
    elapsed = statistics.median(r[0] for r in runs)
    ttft = statistics.median(r[1] for r in runs)
    tpot = (elapsed - ttft) / max(output_len - 1, 1)
    input_len = round(sum(map(len, all_prompts)) / len(all_prompts))
    return dict(
        num_prompts=batch, batch_size=batch, input_len=input_len, output_len=output_len,
        latency_s=round(elapsed, 4), ttft_ms=round(ttft * 1e3, 2), tpot_ms=round(tpot * 1e3, 3),
        output_tok_s=round(batch * output_len / elapsed, 1),
        total_tok_s=round(batch * (input_len + output_len) / elapsed, 1), engine="pagoda",
        **workload_summary(args, all_prompts, all_outputs),
        **spec_decode_summary(engine, spec_before),
    )


def add_latency_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_engine_args(parser)
    add_workload_args(parser)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1])
    parser.add_argument("--input-len", type=int, nargs="+", default=[512],
                        help="one or more prompt lengths (a long-context sweep: 8192 32768)")
    parser.add_argument("--output-len", type=int, nargs="+", default=[128],
                        help="one or more output lengths (a latency-vs-length sweep)")
    parser.add_argument("--num-iters", type=int, default=3)
    return parser


def run_latency(args: argparse.Namespace) -> int:
    from inference import LLM

    folder, extra = resolve_shape_model(bench_model(args))
    copy_model_folder(args, folder, extra)
    max_out = max(args.output_len)
    llm = LLM(folder, **(extra | engine_kwargs(args, workload_input_len(args) + max_out)))
    install_copy_model(args, llm.engine)
    results = []
    sweep = [(i, o, b) for i in args.input_len for o in args.output_len for b in args.batch_size]
    for input_len, output_len, batch in sweep:
        result = _measure(llm, args, batch, input_len, output_len)
        results.append(record("latency", model=args.model,
                              tensor_parallel_size=llm.engine.config.tensor_parallel_size,
                              quantization=llm.engine.config.quantization,
                              kv_cache_dtype=llm.engine.config.kv_cache_dtype,
                              **result))
        print(f"batch {batch:4d} in {result['input_len']:6d} out {output_len:5d}: "
              f"{result['latency_s'] * 1e3:9.1f} ms  "
              f"TTFT {result['ttft_ms']:8.1f} ms  TPOT {result['tpot_ms']:7.3f} ms  "
              f"{result['output_tok_s']:9.0f} out tok/s"
              + (f"  copy rate {100 * result['copy_rate']:.0f} %"
                 if "copy_rate" in result else ""))
        if "mean_acceptance_length" in result:
            print("  " + spec_decode_line(result))
    write_results(args, results)
    return 0



if __name__ == "__main__":
    raise SystemExit(bench_main(add_latency_args, run_latency, "pagoda bench latency"))
