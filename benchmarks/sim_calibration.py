"""``python -m benchmarks.sim_calibration``: the engine numbers the operator's tuning
simulator is calibrated on, measured through the public engine API on one card.

For each named shape (random bf16 weights, engine defaults otherwise):

- **KV capacity** in tokens at several ``gpu_memory_utilization`` values: the engine's own
  block count. One start profiles at the default 0.9; the block count is linear in the
  utilization (``(total * u - peak - other) // bytes_per_block``, ``model_runner``), so the
  other values are derived from that start's pieces (``--kv-starts`` starts an engine per value
  instead, to check the derivation).
- **Decode step time** against batch size and context length: ``B`` random prompts of
  ``C`` tokens are prefilled once, then the wall time of ``--decode-steps`` pure decode
  steps is timed; the batch is cut down to the next size by aborting requests (the survivors
  keep their contexts), so one prefill serves every batch size of a context. Combinations
  whose KV does not fit, or whose prefill exceeds ``--max-prefill-tokens``, are listed as
  skipped with the reason.
- **Prefill throughput** for prompt chunks of several sizes: one prompt alone (its time to
  first token), and a full step's token budget of such prompts at once.
- **Preemption cost**: this engine preempts by recomputation, so the cost of preempting a
  sequence is the prefill of its whole context again (no prefix-cache hits: fresh tokens).
- **Recapture** (``recapture_s``): every CUDA graph recorded again in the running engine,
  what a live KV resize stalls it for (the start-up capture also compiles the kernels).

The result is one JSON (``--output-json``) that ``operator/pagoda_operator/tuning/sim`` reads
as data; the operator never imports this package. ``--smoke`` runs a tiny random shape on CPU
in seconds (CI checks the plumbing and the JSON's layout, not the numbers).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from inference.bench.common import bench_main, random_prompts, record, write_json
from inference.model_shapes import SHAPES, resolve_shape_model

# A scaled-down Qwen2 (same layout, tiny sizes) for --smoke on CPU.
SMOKE_SHAPE: dict[str, Any] = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 4096,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "eos_token_id": 1,
}

_WARMUP_STEPS = 4


def add_sim_calibration_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--models", nargs="+", default=["qwen2.5-1.5b", "qwen2.5-7b"],
                        choices=sorted(SHAPES), help="named shapes to measure")
    parser.add_argument("--utilizations", type=float, nargs="+", default=[0.8, 0.9, 0.95],
                        help="gpu_memory_utilization values whose KV capacity is reported")
    parser.add_argument("--kv-starts", action="store_true",
                        help="start an engine per utilization instead of deriving the "
                             "capacities from the 0.9 start's memory profile")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 16384])
    parser.add_argument("--decode-steps", type=int, default=24,
                        help="decode steps timed per (batch, context)")
    parser.add_argument("--max-prefill-tokens", type=int, default=1 << 19,
                        help="skip decode points whose prefill (batch x context) exceeds this")
    parser.add_argument("--chunks", type=int, nargs="+", default=[512, 2048, 8192],
                        help="prompt chunk sizes whose prefill throughput is measured")
    parser.add_argument("--recompute-contexts", type=int, nargs="+", default=[4096, 16384],
                        help="contexts whose recomputation (the cost of a preemption) is timed")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each prefill timing")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny random shape on CPU with small sizes: checks the plumbing "
                             "in seconds")
    parser.add_argument("--output-json", default=None)
    return parser


def _smoke_overrides(args: argparse.Namespace) -> None:
    args.models = ["smoke"]
    args.batches = [1, 4, 8]
    args.contexts = [32, 256]
    args.decode_steps = 4
    args.chunks = [32, 128]
    args.recompute_contexts = [64, 256]
    args.repeats = 1


def _model_folder(name: str) -> tuple[str, dict[str, Any]]:
    if name == "smoke":
        folder = Path(tempfile.mkdtemp(prefix="pagoda-smoke-"))
        (folder / "config.json").write_text(json.dumps(SMOKE_SHAPE))
        return str(folder), {"load_format": "dummy", "device": "cpu", "dtype": "float32",
                             "cpu_kv_cache_gib": 0.05}
    return resolve_shape_model(name)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _start(folder: str, extra: dict[str, Any], max_model_len: int, utilization: float | None):
    from inference import LLM

    kwargs = dict(extra, max_model_len=max_model_len)
    if utilization is not None:
        kwargs["gpu_memory_utilization"] = utilization
    t0 = time.perf_counter()
    llm = LLM(folder, **kwargs)
    return llm, time.perf_counter() - t0


def _free(llm) -> None:
    llm.shutdown()
    del llm
    _release_memory()


def _release_memory() -> int:
    """Collect the dropped engine and give its memory back; the bytes still allocated."""
    import torch

    gc.collect()
    if not torch.cuda.is_available():
        return 0
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def _params(max_tokens: int):
    from inference import SamplingParams

    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens,
                          detokenize=False)


def _kv_capacity(engine, utilizations: list[float], measured: dict[float, int]) -> list[dict]:
    """Capacity per utilization: measured block counts where an engine was started at that
    value, else derived from the default start's block count and the card's total memory
    (the profile's peak and the memory outside torch do not depend on the utilization)."""
    import torch

    block_size = engine.config.block_size
    base_u = engine.config.gpu_memory_utilization
    base_blocks = engine.num_total_blocks
    rows = []
    for u in utilizations:
        if u in measured:
            blocks, method = measured[u], "measured"
        elif engine.device.type == "cuda":
            total = torch.cuda.mem_get_info(engine.device)[1]
            blocks = base_blocks + int((u - base_u) * total // engine.runner.bytes_per_block)
            method = f"derived from the {base_u} start"
        else:
            blocks, method = base_blocks, "cpu budget (independent of the utilization)"
        rows.append({"gpu_memory_utilization": u, "blocks": blocks,
                     "tokens": blocks * block_size, "method": method})
    return rows


def _decode_tokens(args: argparse.Namespace, prefill_steps: int) -> int:
    return prefill_steps + 8 + (_WARMUP_STEPS + args.decode_steps) * len(set(args.batches))


def _decode_grid(engine, args: argparse.Namespace, capacity_tokens: int) -> tuple[list, list]:
    """Step time of pure decode steps per (batch, context); see the module docstring."""
    vocab = engine.model_config.vocab_size
    max_seqs = engine.config.max_num_seqs
    rows, skipped = [], []
    budget = engine.config.max_num_batched_tokens
    batches = sorted(set(args.batches), reverse=True)
    for context in args.contexts:
        # Tokens each sequence may generate: while the others are prefilled, then at
        # every batch level; none may finish before the smallest level is timed.
        max_tokens = _decode_tokens(args, max(batches) * context // budget)
        grown = context + max_tokens
        levels = []
        for batch in batches:
            if batch > max_seqs:
                reason = f"above max_num_seqs {max_seqs}"
            elif batch * grown > capacity_tokens:
                reason = f"KV needs {batch * grown} tokens; the cache holds {capacity_tokens}"
            elif batch > 1 and batch * context > args.max_prefill_tokens:
                reason = f"prefill of {batch * context} tokens above --max-prefill-tokens"
            else:
                levels.append(batch)
                continue
            skipped.append({"batch": batch, "context": context, "reason": reason})
        if not levels:
            continue
        prompts = random_prompts(levels[0], context, vocab, seed=context)
        ids = [f"decode-{context}-{i}" for i in range(levels[0])]
        params = _params(max_tokens)
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, prompt, params)
        started: set[str] = set()
        while len(started) < len(ids):  # prefill every prompt (chunked by the engine)
            started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
        for batch in levels:
            engine.abort_request(ids[batch:])
            del ids[batch:]
            for _ in range(_WARMUP_STEPS):
                engine.step()
            _sync()
            t0 = time.perf_counter()
            for _ in range(args.decode_steps):
                engine.step()
            _sync()
            step_s = (time.perf_counter() - t0) / args.decode_steps
            rows.append({"batch": batch, "context": context, "step_ms": round(step_s * 1e3, 3),
                         "decode_tok_s": round(batch / step_s, 1)})
            print(f"decode batch {batch:4d} context {context:6d}: {step_s * 1e3:8.2f} ms/step")
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
    return rows, skipped


def _timed_generate(llm, prompts: list[list[int]]) -> float:
    _sync()
    t0 = time.perf_counter()
    llm.generate(prompts, _params(1), use_tqdm=False)
    _sync()
    return time.perf_counter() - t0


def _prefill(llm, args: argparse.Namespace) -> list[dict]:
    """Prefill of chunks of each size: one prompt alone, and a step's budget of them."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    budget = engine.config.max_num_batched_tokens
    rows = []
    for chunk in args.chunks:
        if chunk > budget:
            continue
        for mode, count in (("single", 1), ("packed", max(1, budget // chunk))):
            times = [
                _timed_generate(llm, random_prompts(count, chunk, vocab,
                                                    seed=7919 * chunk + 31 * rep + count))
                for rep in range(args.repeats)
            ]
            elapsed = statistics.median(times)
            rows.append({"chunk": chunk, "mode": mode, "prompts": count,
                         "seconds": round(elapsed, 5),
                         "tokens_s": round(count * chunk / elapsed, 1)})
            print(f"prefill {mode:6s} {count:3d} x {chunk:5d}: {count * chunk / elapsed:10.0f} tok/s")
    return rows


def _recompute(llm, args: argparse.Namespace) -> list[dict]:
    """A preempted sequence is recomputed from scratch: time the prefill of its context
    (fresh tokens, so the prefix cache cannot make it free)."""
    vocab = llm.engine.model_config.vocab_size
    rows = []
    for context in args.recompute_contexts:
        times = [_timed_generate(llm, random_prompts(1, context, vocab, seed=104729 + context + rep))
                 for rep in range(args.repeats)]
        elapsed = statistics.median(times)
        rows.append({"context": context, "seconds": round(elapsed, 4),
                     "tokens_s": round(context / elapsed, 1)})
        print(f"recompute {context:6d} tokens: {elapsed * 1e3:8.1f} ms")
    return rows


def _measure_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    folder, extra = _model_folder(name)
    longest = max([*args.contexts, *args.chunks, *args.recompute_contexts])
    # Room for the decode grid's generated tokens (a smaller step budget only means more
    # prefill steps, bounded by max_num_batched_tokens >= 2048 on every device).
    prefill_steps = max(args.batches) * max(args.contexts) // 2048
    max_model_len = longest + _decode_tokens(args, prefill_steps)
    measured: dict[float, int] = {}
    if args.kv_starts and torch.cuda.is_available():
        for u in args.utilizations:
            if u != 0.9:
                llm, _ = _start(folder, extra, max_model_len, u)
                measured[u] = llm.engine.num_total_blocks
                _free(llm)
    llm, startup_s = _start(folder, extra, max_model_len, None)
    engine = llm.engine
    measured[engine.config.gpu_memory_utilization] = engine.num_total_blocks
    cfg = engine.model_config
    llm.generate(random_prompts(2, 64, cfg.vocab_size, seed=1), _params(4), use_tqdm=False)
    capacity = engine.num_total_blocks * engine.config.block_size
    t0 = time.perf_counter()
    decode, skipped = _decode_grid(engine, args, capacity)
    prefill = _prefill(llm, args)
    recompute = _recompute(llm, args)
    # What a live KV resize stalls the engine for: every CUDA graph recorded again in the
    # running engine (its kernels already compiled, unlike the start-up capture).
    recapture_s = engine.runner.capture_graphs()
    result = {
        "shape": {"num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
                  "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                  "vocab_size": cfg.vocab_size},
        "dtype": str(engine.dtype),
        "kv_bytes_per_token": engine.runner.bytes_per_block // engine.config.block_size,
        "block_size": engine.config.block_size,
        "max_num_seqs": engine.config.max_num_seqs,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "gpu_total_bytes": (torch.cuda.mem_get_info(engine.device)[1]
                            if engine.device.type == "cuda" else None),
        "startup_s": round(startup_s, 2),
        "startup_phases": engine.startup_phases,
        "recapture_s": round(recapture_s, 2),
        "kv_capacity": _kv_capacity(engine, args.utilizations, measured),
        "decode": decode,
        "decode_skipped": skipped,
        "prefill": prefill,
        "recompute": recompute,
        "measure_s": round(time.perf_counter() - t0, 1),
    }
    llm.shutdown()
    return result


def run_sim_calibration(args: argparse.Namespace) -> int:
    if args.smoke:
        _smoke_overrides(args)
    t0 = time.perf_counter()
    models = {}
    for name in args.models:
        print(f"== {name}")
        models[name] = _measure_model(name, args)
        # Between models, out of _measure_model's frame: nothing refers to its engine.
        models[name]["allocated_after_free_bytes"] = _release_memory()
    result = record("sim_calibration", models=models, smoke=args.smoke,
                    decode_steps=args.decode_steps, total_s=round(time.perf_counter() - t0, 1))
    write_json(args.output_json, result)
    print(f"done in {result['total_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(bench_main(add_sim_calibration_args, run_sim_calibration,
                                "pagoda bench sim_calibration"))
