"""``pagoda bench latency``: a batch of B requests at once; end-to-end latency, time to
first token and time per output token, for each batch size asked for."""

from __future__ import annotations

import argparse
import statistics
import time

from inference.bench.common import (
    add_engine_args,
    engine_kwargs,
    random_prompts,
    record,
    resolve_bench_model,
    write_json,
)


def add_latency_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_engine_args(parser)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters", type=int, default=3)
    return parser


def run_latency(args: argparse.Namespace) -> int:
    from inference import LLM, SamplingParams

    folder, extra = resolve_bench_model(args.model)
    llm = LLM(folder, **engine_kwargs(args, args.input_len + args.output_len), **extra)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len,
                            detokenize=False)
    results = []
    for batch in args.batch_size:
        prompts = random_prompts(batch, args.input_len, vocab, seed=batch)
        llm.generate(prompts, params, use_tqdm=False)  # warm-up at this size
        runs = []
        for it in range(args.num_iters):
            # Fresh prompts each iteration: the prefix cache must not make later runs free.
            prompts = random_prompts(batch, args.input_len, vocab, seed=1000 * batch + it)
            start = time.perf_counter()
            wall0 = time.time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            ttft = statistics.mean(o.metrics.first_token_time - wall0 for o in outs)
            runs.append((elapsed, ttft))
        elapsed = statistics.median(r[0] for r in runs)
        ttft = statistics.median(r[1] for r in runs)
        tpot = (elapsed - ttft) / max(args.output_len - 1, 1)
        result = record(
            "latency", model=args.model, num_prompts=batch, batch_size=batch,
            input_len=args.input_len, output_len=args.output_len,
            latency_s=round(elapsed, 4), ttft_ms=round(ttft * 1e3, 2),
            tpot_ms=round(tpot * 1e3, 3),
            output_tok_s=round(batch * args.output_len / elapsed, 1),
            total_tok_s=round(batch * (args.input_len + args.output_len) / elapsed, 1),
            engine="pagoda",
        )
        results.append(result)
        print(f"batch {batch:4d}: {elapsed * 1e3:9.1f} ms  TTFT {result['ttft_ms']:8.1f} ms  "
              f"TPOT {result['tpot_ms']:7.3f} ms  {result['output_tok_s']:9.0f} out tok/s")
    write_json(args.output_json, results)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_latency(add_latency_args(argparse.ArgumentParser(prog="pagoda bench latency")).parse_args(argv))


if __name__ == "__main__":
    import logging
    import sys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    sys.exit(main())
