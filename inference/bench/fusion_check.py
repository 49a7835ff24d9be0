"""RMSNorm fused into the projection after it (``kernels.rms_norm_linear``), checked and
timed on the GPU in one call, fused against unfused.

    PYTHONUNBUFFERED=1 python3 -m inference.bench.fusion_check       # on the GPU
    python3 -m inference.bench.fusion_check --smoke                  # CPU, seconds (CI)

1. Kernels, on the Qwen2.5-1.5B and 7B layer shapes (qkv with its bias; gate_up with
   SiLU-and-mul), bf16, M = 1, 2, 4 wherever the dispatch fuses: the compiled kernel
   against float64 and against the unfused ops, the residual it writes bit-equal to
   ``x + residual`` in bf16, CUDA-graph capture then replay on new inputs equal to an eager
   call, and the time per call of fused vs unfused (norm + GEMV) under CUDA-graph replay
   (``do_bench_cudagraph`` median, weights rotated over >= 300 MB so L2 never holds them);
   for the 1.5B at M = 1 (the batch-1 target) also a few other fused configs, since the
   shipped ones were measured for the plain GEMV (the fused kernel holds more registers).
2. Greedy tokens, fused against unfused, on a random model with the 1.5B layer shape and
   realistic weight statistics (``fp8_check.write_realistic_model``, 6 layers), 8 prompts
   x 32 tokens, two sequences at a time (decode steps of M <= 2: the fused kernels). bf16
   is not bit-exact between the two paths (the fused one skips two roundings), so this
   reports how often they agree (``fp8_check.agreement``) rather than asserting equality.
3. Engine: ``pagoda bench latency`` at batch 1, 512 in / 128 out, per model, unfused
   (``PAGODA_DISABLE_NORM_FUSION=1``) then fused, each in its own process.

``--smoke`` runs part 1 on tiny shapes under Triton's interpreter (no graphs, no timing)
and parts 2 and 3 on a tiny random model on CPU, to check the plumbing. One JSON (default
``inference/bench/results/fusion_check.json``; none for ``--smoke`` unless
``--output-json``) with the command, the commit and the hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from inference.bench.common import record, write_json

EPS = 1e-6
DISABLE_ENV = "PAGODA_DISABLE_NORM_FUSION"  # kernels/norm_linear.py
# name -> (hidden, qkv rows, intermediate): one rank's layer at TP=1.
SHAPES = {"1.5B": (1536, 2048, 8960), "7B": (3584, 4608, 18944)}
SMOKE_SHAPES = {"tiny": (96, 64, 80)}
ROTATE_BYTES = 300 * 2**20
# Fused configs timed beside the dispatch's for the 1.5B at M = 1: (block_n, block_k, warps).
SWEEP = {"qkv": [(1, 1024, 4), (2, 1024, 4), (4, 512, 4), (1, 2048, 8)],
         "gate_up+silu": [(4, 256, 4), (2, 512, 4), (1, 1024, 4), (8, 256, 8)]}
# bf16 output against float64: the unfused ops land near 3e-3 on these shapes.
MAX_REL_ERR = 1e-2


def _fuses(m: int, n: int, k: int, gated: bool, device) -> bool:
    """Whether ``rms_norm_linear`` takes the fused kernel for this bf16 shape."""
    import torch

    from kernels.norm_linear import fused_config

    return fused_config(m, n, k, torch.bfloat16, device, gated) is not None


def _ops(gated: bool):
    """(fused, unfused) callables of (x, residual, norm, weight, bias) -> (out, summed)."""
    import kernels

    def fused(x, residual, norm, weight, bias):
        if gated:
            return kernels.rms_norm_linear_silu_and_mul(x, residual, norm, EPS, weight)
        return kernels.rms_norm_linear(x, residual, norm, EPS, weight, bias)

    def unfused(x, residual, norm, weight, bias):
        normed, summed = kernels.fused_add_rms_norm(x, residual, norm, EPS)
        if gated:
            return kernels.linear_silu_and_mul(normed, weight), summed
        return kernels.linear(normed, weight, bias), summed

    return fused, unfused


def _graph_us(fn, calls: int) -> float:
    import triton

    fn()  # compile outside the capture
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3 / calls


def check_case(name: str, hidden: int, n: int, m: int, gated: bool, device,
               timing: bool) -> dict[str, Any]:  # fmt: skip
    import torch

    from kernels._float64 import rel_err, rms_norm64, silu_and_mul64

    bf16 = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(1000 * m + n)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    x, residual = randn(m, hidden).to(bf16), (4 * randn(m, hidden)).to(bf16)
    norm = (1 + 0.2 * randn(hidden)).to(bf16)
    weight = (randn(n, hidden) / hidden**0.5).to(bf16)
    bias = None if gated else randn(n).to(bf16)
    fused, unfused = _ops(gated)

    summed64 = x.float() + residual.float()
    truth = rms_norm64(summed64.to(bf16), norm, EPS) @ weight.double().T
    if bias is not None:
        truth = truth + bias.double()
    if gated:
        truth = silu_and_mul64(truth)
    out, summed = fused(x, residual, norm, weight, bias)
    reference, _ = unfused(x, residual.clone(), norm, weight, bias)
    result: dict[str, Any] = {
        "shape": name, "proj": "gate_up+silu" if gated else "qkv", "m": m, "n": n, "k": hidden,
        "rel_err_fused": rel_err(out, truth), "rel_err_unfused": rel_err(reference, truth),
        "rel_diff_fused_unfused": rel_err(out, reference),
        # The interpreter truncates float32 -> bf16 (compiled kernels round to nearest, as
        # torch does): the exact check is for the GPU.
        "residual_exact": bool(torch.equal(summed, x + residual)) if x.is_cuda else None,
    }  # fmt: skip
    ok = result["rel_err_fused"] <= MAX_REL_ERR and result["residual_exact"] is not False
    if x.is_cuda:
        static = [x.clone(), residual.clone()]
        graph = torch.cuda.CUDAGraph()
        fused(*static, norm, weight, bias)  # compiled before capture
        with torch.cuda.graph(graph):
            graph_out, graph_summed = fused(*static, norm, weight, bias)
        new_x, new_residual = randn(m, hidden).to(bf16), randn(m, hidden).to(bf16)
        static[0].copy_(new_x)
        static[1].copy_(new_residual)
        graph.replay()
        eager_out, eager_summed = fused(new_x, new_residual, norm, weight, bias)
        result["graph_replay_equal"] = bool(
            torch.equal(graph_out, eager_out) and torch.equal(graph_summed, eager_summed)
        )
        ok = ok and result["graph_replay_equal"]
    if timing:
        copies = max(2, -(-ROTATE_BYTES // weight.nbytes))
        weights = [weight] + [weight.clone() for _ in range(copies - 1)]
        for label, op in (("unfused_us", unfused), ("fused_us", fused)):
            def run(op=op) -> None:
                for w in weights:
                    op(x, residual, norm, w, bias)

            result[label] = round(_graph_us(run, copies), 2)
        result["saved_us"] = round(result["unfused_us"] - result["fused_us"], 2)
        if name == "1.5B" and m == 1:
            result["sweep_us"] = _sweep(x, residual, norm, weights, bias, gated)
        del weights
    result["ok"] = bool(ok)
    return result


def _sweep(x, residual, norm, weights, bias, gated: bool) -> dict[str, float]:
    """The fused kernel's time per call with other fma configs (same inputs, rotated weights)."""
    from kernels._gemv_table import GemvConfig
    from kernels._triton import linear as triton_linear

    times = {}
    for block_n, block_k, warps in SWEEP["gate_up+silu" if gated else "qkv"]:
        config = GemvConfig("fma", block_n, block_k, 1, warps)

        def run(config=config) -> None:
            for w in weights:
                triton_linear.rms_norm_linear(x, residual, norm, EPS, w, bias, config, gated=gated)

        times[config.short()] = round(_graph_us(run, len(weights)), 2)
    return times


def kernel_checks(shapes: dict[str, tuple[int, int, int]], ms: list[int], device,
                  timing: bool) -> list[dict[str, Any]]:  # fmt: skip
    rows = []
    for name, (hidden, qkv_rows, intermediate) in shapes.items():
        for gated, n in ((False, qkv_rows), (True, 2 * intermediate)):
            for m in ms:
                if not _fuses(m, n, hidden, gated, device):
                    print(f"{name} {'gate_up' if gated else 'qkv'} M={m}: not fused "
                          "(the unfused GEMV is not the fma kernel here)", flush=True)  # fmt: skip
                    continue
                row = check_case(name, hidden, n, m, gated, device, timing)
                rows.append(row)
                timing_text = (f"; unfused {row['unfused_us']} us -> fused {row['fused_us']} us"
                               if timing else "")  # fmt: skip
                if "sweep_us" in row:
                    timing_text += f"; other fused configs (us) {row['sweep_us']}"
                print(f"{name} {row['proj']} M={m}: rel err fused {row['rel_err_fused']:.2e} "
                      f"(unfused {row['rel_err_unfused']:.2e}); residual exact "
                      f"{row['residual_exact']}; graph replay {row.get('graph_replay_equal')}"
                      f"{timing_text}; {'OK' if row['ok'] else 'FAILED'}", flush=True)  # fmt: skip
    return rows


class _Env:
    """``with _Env({"NAME": value or None}):`` sets (None: removes) environment variables
    for this process (an engine built inside, and its workers, see them), then restores
    them."""

    def __init__(self, values: dict[str, str | None]) -> None:
        self.values = values
        self.saved: dict[str, str | None] = {}

    def __enter__(self) -> None:
        for name, value in self.values.items():
            self.saved[name] = os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value

    def __exit__(self, *exc: object) -> None:
        for name, value in self.saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def _fusion(on: bool) -> _Env:
    return _Env({DISABLE_ENV: None if on else "1"})


def greedy_agreement(folder: Path, vocab_size: int, device: str) -> dict[str, Any]:
    from inference.bench.common import random_prompts
    from inference.bench.fp8_check import _greedy, _release_memory, agreement

    prompts = random_prompts(8, 48, vocab_size, seed=5)
    engine = {"max_model_len": 128, "max_num_seqs": 2, "device": device}
    if device == "cuda":
        engine["gpu_memory_utilization"] = 0.3
    runs = {}
    for fused in (False, True):
        with _fusion(fused):
            runs[fused] = _greedy(folder, prompts, 32, engine, None)
        _release_memory()
    result = agreement(runs[False], runs[True])
    result["first_token_agreement"] = round(
        sum(a[0] == b[0] for a, b in zip(runs[False], runs[True], strict=True)) / len(prompts), 3
    )
    print(f"greedy fused vs unfused ({folder.name}, 8 x 32 tokens): {result}", flush=True)
    return result


def _latency(model: str, fused: bool, argv: list[str], workdir: Path, in_process: bool) -> dict:
    """``pagoda bench latency`` with the fusion on or off, in its own process on the GPU."""
    label = "fused" if fused else "unfused"
    out = workdir / f"latency_{Path(model).name}_{label}.json"
    full = ["--model", model, "--output-json", str(out), *argv]
    env = dict(os.environ)
    env.pop(DISABLE_ENV, None)
    if not fused:
        env[DISABLE_ENV] = "1"
    if in_process:
        from inference.bench import latency
        from inference.bench.common import bench_main

        with _fusion(fused):
            bench_main(latency.add_latency_args, latency.run_latency, "latency", full)
    else:
        command = [sys.executable, "-m", "inference.bench.latency", *full]
        print(f"+ {DISABLE_ENV}={env.get(DISABLE_ENV, '')} " + " ".join(command), flush=True)
        subprocess.run(command, check=True, env=env)
    rows = json.loads(out.read_text())
    row = rows[0] if isinstance(rows, list) else rows
    row["norm_fusion"] = fused
    return row


def engine_speed(models: list[str], args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    argv = ["--batch-size", "1", "--input-len", str(args.input_len), "--output-len",
            str(args.output_len), "--num-iters", str(args.num_iters)]  # fmt: skip
    if args.smoke:
        argv += ["--device", "cpu"]
    results = {}
    for model in models:
        unfused = _latency(model, False, argv, workdir, args.smoke)
        fused = _latency(model, True, argv, workdir, args.smoke)
        name = Path(model).name
        results[name] = {"unfused": unfused, "fused": fused,
                         "speedup": round(fused["output_tok_s"] / unfused["output_tok_s"], 3)}
        print(f"{name} batch 1, {args.input_len} in / {args.output_len} out: unfused "
              f"{unfused['output_tok_s']} tok/s (TPOT {unfused['tpot_ms']} ms) -> fused "
              f"{fused['output_tok_s']} tok/s (TPOT {fused['tpot_ms']} ms), "
              f"x{results[name]['speedup']}", flush=True)  # fmt: skip
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fusion_check", description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (plumbing)")
    parser.add_argument("--models", nargs="+", default=["qwen2.5-1.5b", "qwen2.5-7b"])
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--skip-engine", action="store_true", help="kernels only")
    parser.add_argument("--output-json", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    device = torch.device("cpu" if args.smoke else "cuda")
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    # Smoke: the kernels under the interpreter (set before their first import); the engine
    # on CPU afterwards runs the references, as configured.
    kernel_env = {"TRITON_INTERPRET": "1", "PAGODA_DISABLE_TRITON": None} if args.smoke else {}
    with _Env(kernel_env), torch.no_grad():
        kernels_rows = kernel_checks(shapes, args.ms, device, timing=not args.smoke)
    result: dict[str, Any] = {"kernels": kernels_rows, "smoke": args.smoke}
    with tempfile.TemporaryDirectory(prefix="fusion-check-") as tmp:
        workdir = Path(tmp)
        models = args.models
        from inference.bench.fp8_check import RANDOM_CONFIG, SMOKE_CONFIG, write_realistic_model

        config = SMOKE_CONFIG if args.smoke else RANDOM_CONFIG
        folder = workdir / "random-qwen2-realistic"
        if not args.skip_engine:
            write_realistic_model(folder, config)
            result["greedy"] = greedy_agreement(folder, config["vocab_size"], device.type)
        if args.smoke:
            models = [str(folder)]
        if not args.skip_engine:
            result["engine"] = engine_speed(models, args, workdir)
    failed = [row for row in kernels_rows if not row["ok"]]
    result["ok"] = not failed
    output = args.output_json or (None if args.smoke else
                                  "inference/bench/results/fusion_check.json")  # fmt: skip
    write_json(output, record("fusion_check", **result))
    print(f"kernel checks: {len(kernels_rows) - len(failed)}/{len(kernels_rows)} OK", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
