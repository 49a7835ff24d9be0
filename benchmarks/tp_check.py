"""Tensor parallelism on a multi-GPU host: parity with one GPU, then speed.

    PYTHONUNBUFFERED=1 python3 -m benchmarks.tp_check [--tp 2] [--model qwen2.5-7b]

Part 1 (parity) saves a small random Qwen2-style model (qkv bias, 2 KV heads so that TP=2
holds one each, an odd vocabulary so that the vocabulary shards are padded) as a real
safetensors folder, and runs the same greedy workload at TP=1 and TP=N, in float32 and in
bfloat16: the share of sequences whose tokens are identical, the mean length of the common
prefix, and the largest difference of the chosen tokens' logprobs along it. float32 should
match exactly or nearly; bfloat16 rounds differently once the sums are split, so long
greedy runs may part after a near-tie: it is judged against bfloat16's own noise floor,
reported beside it (TP=1 bfloat16 vs TP=1 float32). On CPU (gloo) this measured float32:
32/32 identical, max logprob difference 1e-5; bfloat16: TP=2 vs TP=1 as far apart as
bfloat16 vs float32 on one rank.
Part 2 (speed) runs ``pagoda bench latency`` (batch 1) and ``pagoda bench throughput`` for
``--model`` at TP=1 and TP=N, each in its own process (each takes
``--gpu-memory-utilization`` of every GPU it uses).
Everything lands in one JSON (default benchmarks/results/tp_check_<model>.json) with
the command, the commit and the hardware.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from inference.bench.common import record, write_json

PARITY_CONFIG: dict[str, Any] = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 32001,
    "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4,
    "num_attention_heads": 16, "num_key_value_heads": 2, "max_position_embeddings": 4096,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "eos_token_id": 0,
}
PARITY_PROMPTS, PARITY_PROMPT_LEN, PARITY_NEW_TOKENS = 32, 64, 64


def write_random_model(folder: Path, config: dict[str, Any], seed: int = 0) -> None:
    """A Hugging Face folder (config.json + model.safetensors) with random weights, scaled
    so that activations stay O(1) and the logits are peaked enough for greedy decoding."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    q, kv = hidden, config["num_key_value_heads"] * head_dim

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": randn(config["vocab_size"], hidden, scale=1.0),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": randn(config["vocab_size"], hidden, scale=4.0 / hidden**0.5),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": randn(q, hidden, scale=hidden**-0.5),
            p + "self_attn.q_proj.bias": randn(q, scale=0.1),
            p + "self_attn.k_proj.weight": randn(kv, hidden, scale=hidden**-0.5),
            p + "self_attn.k_proj.bias": randn(kv, scale=0.1),
            p + "self_attn.v_proj.weight": randn(kv, hidden, scale=hidden**-0.5),
            p + "self_attn.v_proj.bias": randn(kv, scale=0.1),
            p + "self_attn.o_proj.weight": randn(hidden, q, scale=q**-0.5),
            p + "mlp.gate_proj.weight": randn(inter, hidden, scale=hidden**-0.5),
            p + "mlp.up_proj.weight": randn(inter, hidden, scale=hidden**-0.5),
            p + "mlp.down_proj.weight": randn(hidden, inter, scale=inter**-0.5),
        }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))


def parity_run(folder: str, tp: int, dtype: str, out: str) -> None:
    """One engine; greedy tokens and each chosen token's logprob, as JSON in ``out``."""
    from inference import LLM, SamplingParams
    from inference.bench.common import random_prompts

    prompts = random_prompts(PARITY_PROMPTS, PARITY_PROMPT_LEN, PARITY_CONFIG["vocab_size"])
    params = SamplingParams(temperature=0.0, max_tokens=PARITY_NEW_TOKENS, ignore_eos=True,
                            logprobs=1, detokenize=False)
    with LLM(folder, tensor_parallel_size=tp, dtype=dtype, gpu_memory_utilization=0.5,
             max_model_len=PARITY_PROMPT_LEN + PARITY_NEW_TOKENS) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    rows = []
    for o in outs:
        c = o.outputs[0]
        rows.append({"tokens": c.token_ids,
                     "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]})
    Path(out).write_text(json.dumps(rows))


def compare(single: list[dict], parallel: list[dict]) -> dict[str, Any]:
    exact, prefix_lens, max_diff, first_equal = 0, [], 0.0, 0
    for a, b in zip(single, parallel, strict=True):
        n = 0
        while n < len(a["tokens"]) and a["tokens"][n] == b["tokens"][n]:
            n += 1
        exact += n == len(a["tokens"])
        first_equal += n > 0
        prefix_lens.append(n)
        diffs = [abs(x - y) for x, y in zip(a["logprobs"][:n], b["logprobs"][:n])]
        max_diff = max([max_diff, *diffs])
    count = len(single)
    return {
        "sequences": count,
        "identical_fraction": round(exact / count, 3),
        "first_token_equal_fraction": round(first_equal / count, 3),
        "mean_common_prefix": round(sum(prefix_lens) / count, 1),
        "max_logprob_diff_on_common_prefix": round(max_diff, 5),
    }


def _python(*args: str) -> None:
    command = [sys.executable, "-m", *args]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def run_parity(tp: int, workdir: Path) -> dict[str, Any]:
    folder = workdir / "parity-model"
    write_random_model(folder, PARITY_CONFIG)
    results, runs = {}, {}
    for dtype in ("float32", "bfloat16"):
        for size in (1, tp):
            out = workdir / f"parity_{dtype}_tp{size}.json"
            _python("benchmarks.tp_check", "--parity-run", str(folder), "--tp", str(size),
                    "--dtype", dtype, "--parity-out", str(out))
            runs[dtype, size] = json.loads(out.read_text())
        results[dtype] = compare(runs[dtype, 1], runs[dtype, tp])
        print(f"parity {dtype} TP=1 vs TP={tp}: {results[dtype]}", flush=True)
    # The yardstick for bfloat16: how far its rounding alone takes one GPU from float32.
    floor = compare(runs["float32", 1], runs["bfloat16", 1])
    results["bfloat16_tp1_vs_float32_tp1"] = floor
    print(f"bfloat16 noise floor (TP=1, bf16 vs fp32): {floor}", flush=True)
    return results


def run_speed(args: argparse.Namespace, workdir: Path) -> dict[str, list]:
    results: dict[str, list] = {"latency": [], "throughput": []}
    for size in (1, args.tp):
        common = ["--model", args.model, "--tensor-parallel-size", str(size),
                  "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        out = workdir / f"latency_tp{size}.json"
        _python("inference.bench.latency", *common, "--batch-size", "1", "--input-len",
                str(args.input_len), "--output-len", str(args.output_len),
                "--output-json", str(out))
        results["latency"] += json.loads(out.read_text())
        out = workdir / f"throughput_tp{size}.json"
        _python("inference.bench.throughput", *common, "--num-prompts", str(args.num_prompts),
                "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                "--output-json", str(out))
        results["throughput"].append(json.loads(out.read_text()))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tp_check")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--model", default="qwen2.5-7b", help="shape for the speed part")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=1024)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--output-json", default=None)
    # Internal: one parity engine in its own process.
    parser.add_argument("--parity-run", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--parity-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.parity_run:
        parity_run(args.parity_run, args.tp, args.dtype, args.parity_out)
        return 0

    start = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="pagoda-tp-check-"))
    result: dict[str, Any] = {"tensor_parallel_size": args.tp, "model": args.model}
    if not args.skip_parity:
        result["parity"] = run_parity(args.tp, workdir)
    if not args.skip_speed:
        speed = run_speed(args, workdir)
        result |= speed
        for kind in ("latency", "throughput"):
            for row in speed[kind]:
                tp = row.get("tensor_parallel_size")
                shown = {k: row[k] for k in ("tpot_ms", "ttft_ms", "output_tok_s") if k in row}
                print(f"{kind:10s} TP={tp}: {shown}", flush=True)
    result["elapsed_s"] = round(time.perf_counter() - start, 1)
    path = args.output_json or str(
        Path(__file__).parent / "results" / f"tp_check_{args.model}.json"
    )
    summary = record("tp_check", **result)
    summary["command"] = " ".join(["python -m benchmarks.tp_check", *sys.argv[1:]])
    write_json(path, summary)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
