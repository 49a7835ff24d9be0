"""Skinny GEMM (decode projections, M <= 16): Triton GEMV configs vs cuBLAS, on one GPU.

    PYTHONUNBUFFERED=1 python3 benchmarks/gemv_check.py [--mode sweep|confirm]
        [--out PATH] [--budget-s 270] [--workers 14]
    python -m benchmarks.gemv_check --fp8 --out $OUT/fp8_sweep.json

It imports only ``kernels``, torch and triton (as a file or with ``-m``). ``--fp8`` runs the
FP8 skinny GEMM sweep instead (``benchmarks/gemv_fp8.py``: kinds and tilings against the
bf16 path and cuBLASLt's FP8 GEMM, the JSON ``kernels._gemv_table.FP8_TABLE`` is filled from).

For the projection shapes of Qwen2.5-1.5B, Qwen2.5-7B and Llama-3-8B (qkv, o, gate_up,
down; LM head last, if time is left) and M = 1, 2, 4, 8, 16, in bf16:

- ``sweep``: compiles every candidate config in parallel worker processes (they fill
  Triton's on-disk cache), then for each case checks each config against a float64
  reference (NaN-poisoned output) and times it with CUDA-graph replay of calls rotated over
  >= 256 MB of weight copies (so L2 never holds the weights), next to ``F.linear``. The best
  config per case and a suggested table go to the JSON.
- ``confirm``: times ``kernels.linear`` (the shipped dispatch) and ``F.linear`` with
  ``triton.testing.do_bench_cudagraph`` (median), checks dispatch output, CUDA-graph
  capture/replay on new inputs, bitwise determinism, and the fused gate_up + SiLU-and-mul.

A short table is printed last; JSON goes to ``--out`` or ``$OUT/gemv_check.json``.
"""

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

import pagoda_kernels as kernels  # noqa: E402
from benchmarks import gemv_fp8  # noqa: E402
from benchmarks.cuda_timing import graph_us  # noqa: E402
from pagoda_kernels import _gemv_table  # noqa: E402
from pagoda_kernels._float64 import rel_err, silu_and_mul64  # noqa: E402
from pagoda_kernels._gemv_table import GemvConfig  # noqa: E402

DTYPE = torch.bfloat16
TOLERANCE = 1e-2
ROTATE_BYTES = 300 * 1024 * 1024  # weights rotated per timing: 5x the 60 MB L2
MS = (1, 2, 4, 8, 16)
MS_RUN = list(MS)  # what a run covers (--ms)
# model -> projection -> (N, K, bias)
SHAPES: dict[str, dict[str, tuple[int, int, bool]]] = {
    "1.5B": {"qkv": (2048, 1536, True), "o": (1536, 1536, False),
             "gate_up": (17920, 1536, False), "down": (1536, 8960, False),
             "lm_head": (151936, 1536, False)},
    "7B": {"qkv": (4608, 3584, True), "o": (3584, 3584, False),
           "gate_up": (37888, 3584, False), "down": (3584, 18944, False),
           "lm_head": (152064, 3584, False)},
    "8B": {"qkv": (6144, 4096, False), "o": (4096, 4096, False),
           "gate_up": (28672, 4096, False), "down": (4096, 14336, False),
           "lm_head": (128256, 4096, False)},
    # One rank's shards at tensor_parallel_size=2 (column-parallel qkv and gate_up halve
    # N, row-parallel o and down halve K; the vocabulary is split too).
    "7B-tp2": {"qkv": (2304, 3584, True), "o": (3584, 1792, False),
               "gate_up": (18944, 3584, False), "down": (3584, 9472, False),
               "lm_head": (76032, 3584, False)},
    "8B-tp2": {"qkv": (3072, 4096, False), "o": (4096, 2048, False),
               "gate_up": (14336, 4096, False), "down": (4096, 7168, False),
               "lm_head": (64128, 4096, False)},
}  # fmt: skip
MODELS = ["1.5B", "7B", "8B"]  # what a run covers (--models)
DEVICE = torch.device("cuda")
results: dict[str, Any] = {"checks": [], "sweep": [], "best": [], "gated": [], "confirm": []}
deadline = math.inf


def out_of_time(reserve_s: float = 0.0) -> bool:
    return time.monotonic() > deadline - reserve_s


def next_pow2(value: int) -> int:
    return triton.next_power_of_2(value)


def fma_candidates(m: int, n: int, k: int, sms: int, gated: bool = False) -> list[GemvConfig]:
    """Row block x K tile x warps with 8..32 weight elements a thread a step (1-4 16-byte
    loads); split-K only where the row blocks alone give < 4 programs per SM."""
    configs = []
    width = n // 2 if gated else n
    for warps in (4, 8):
        for block_n in (1, 2, 4, 8):
            for block_k in (256, 512, 1024, 2048):
                rows = 2 * block_n if gated else block_n
                elems = rows * block_k // (32 * warps)
                if block_k > max(256, next_pow2(k)) or not 8 <= elems <= 32:
                    continue
                programs = -(-width // block_n)
                splits = [1]
                if not gated and programs < 4 * sms:
                    split = 1
                    while programs * split < 4 * sms and split * 2 * block_k <= k:
                        split *= 2
                    splits += sorted({max(2, split // 2), split} - {1})
                configs += [GemvConfig("fma", block_n, block_k, s, warps) for s in splits]
    return configs


def dot_candidates(m: int, n: int, k: int, sms: int) -> list[GemvConfig]:
    configs = []
    for block_n in (16, 32, 64):
        for block_k in (128, 256):
            programs = -(-n // block_n)
            split = 1
            while programs * split < 2 * sms and split * 2 * block_k <= k:
                split *= 2
            for s in sorted({split, split * 2 if split > 1 else 1}):
                for stages in (3, 4):
                    configs.append(GemvConfig("dot", block_n, block_k, s, 4, stages))
    return configs


def candidates(m: int, n: int, k: int, sms: int) -> list[GemvConfig]:
    fma = fma_candidates(m, n, k, sms) if m <= _gemv_table.FMA_MAX_M else []
    return fma + dot_candidates(m, n, k, sms)


def compile_key(m: int, n: int, k: int, bias: bool, config: GemvConfig, gated: bool) -> tuple:
    """What Triton compiles separately (constexprs, specialisation), to compile each once."""
    split_k = 1 if gated else max(1, min(config.split_k, -(-k // config.block_k)))
    per = triton.cdiv(triton.cdiv(k, split_k), config.block_k) * config.block_k
    rows = 1 if m <= 1 else 2 if m <= 2 else 4 if m <= 4 else 8
    return (config.kind, config.block_n, config.block_k, config.num_warps, config.num_stages,
            -(-k // per) > 1, k % per == 0, bias, gated,
            rows if config.kind == "fma" else max(16, next_pow2(m)))  # fmt: skip


def _compile_worker(items: list[tuple]) -> int:
    """Run each (m, n, k, bias, config, gated) once so its kernel lands in the disk cache."""
    from pagoda_kernels._triton import linear as triton_linear

    done = 0
    for m, n, k, bias, config, gated in items:
        try:
            x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
            w = torch.empty(n, k, device=DEVICE, dtype=DTYPE)
            b = torch.empty(n, device=DEVICE, dtype=DTYPE) if bias else None
            out = torch.empty(m, n // 2 if gated else n, device=DEVICE, dtype=DTYPE)
            triton_linear.launch(x, w, b, out, config, gated=gated)
            done += 1
        except Exception as error:  # reported again (with the case) in the main process
            print(f"compile failed {config.short()} m={m} n={n} k={k}: {error}"[:300])
    torch.cuda.synchronize()
    return done


def precompile(items: list[tuple], workers: int) -> None:
    unique: dict[tuple, tuple] = {}
    for item in items:
        unique.setdefault(compile_key(*item), item)
    todo = list(unique.values())
    started = time.monotonic()
    chunks = [todo[i::workers] for i in range(workers)]
    context = multiprocessing.get_context("spawn")
    compiled = -1
    with context.Pool(workers) as pool:
        pending = pool.map_async(_compile_worker, [c for c in chunks if c])
        try:
            compiled = sum(pending.get(timeout=max(10.0, deadline - time.monotonic() - 150)))
        except multiprocessing.TimeoutError:
            print("precompile timed out; the rest compiles on first use")
            pool.terminate()
    elapsed = time.monotonic() - started
    print(f"precompiled {compiled}/{len(todo)} kernels in {elapsed:.0f} s ({workers} processes)")
    results["precompile"] = {"kernels": len(todo), "ok": compiled, "s": elapsed}


class Case:
    """Weight copies (>= ROTATE_BYTES in all) and inputs for one (N, K, M)."""

    def __init__(self, n: int, k: int, m: int, bias: bool, max_sets: int = 64) -> None:
        self.n, self.k, self.m = n, k, m
        weight_bytes = n * k * 2
        self.sets = max(2, min(max_sets, -(-ROTATE_BYTES // weight_bytes)))
        self.weights = [torch.randn(n, k, device=DEVICE, dtype=DTYPE) for _ in range(self.sets)]
        self.biases = [
            torch.randn(n, device=DEVICE, dtype=DTYPE) if bias else None for _ in range(self.sets)
        ]
        self.xs = [torch.randn(m, k, device=DEVICE, dtype=DTYPE) for _ in range(self.sets)]
        self.bytes = weight_bytes + 2 * m * (k + n) + (2 * n if bias else 0)
        self._truth: torch.Tensor | None = None

    def truth(self) -> torch.Tensor:
        if self._truth is None:
            out = self.xs[0].double() @ self.weights[0].double().T
            self._truth = out + self.biases[0].double() if self.biases[0] is not None else out
        return self._truth

    def calls(self, fn: Callable[..., Any]) -> list[Callable[[], Any]]:
        return [
            lambda x=x, w=w, b=b: fn(x, w, b)
            for x, w, b in zip(self.xs, self.weights, self.biases, strict=True)
        ]


def bench_us(calls: list[Callable[[], Any]]) -> float:
    """``triton.testing.do_bench_cudagraph`` (median) over the rotated calls, per call."""

    def run_all() -> None:
        for call in calls:
            call()

    ms = triton.testing.do_bench_cudagraph(run_all, rep=20, return_mode="median")
    return ms * 1e3 / len(calls)


def record_check(name: str, err: float, **info: Any) -> bool:
    ok = err <= TOLERANCE
    results["checks"].append({"name": name, "rel_err": err, "ok": ok, **info})
    if not ok:
        print(f"FAIL {name} {info} rel_err={err:.2e}")
    return ok


def tbps(case: Case, us: float) -> float:
    return case.bytes / us / 1e6


def sweep_case(
    model: str, proj: str, n: int, k: int, bias: bool, m: int, sms: int,
    configs: list[GemvConfig] | None = None,
) -> None:  # fmt: skip
    from pagoda_kernels._triton import linear as triton_linear

    case = Case(n, k, m, bias)
    cublas = graph_us(case.calls(F.linear))
    rows = []
    for config in configs if configs is not None else candidates(m, n, k, sms):
        if out_of_time(35):
            break
        try:
            out = torch.full((m, n), math.nan, device=DEVICE, dtype=DTYPE)
            triton_linear.launch(case.xs[0], case.weights[0], case.biases[0], out, config)
            err = rel_err(out, case.truth())
            ok = record_check("linear", err, model=model, proj=proj, m=m, config=config.short())
            us = graph_us(
                case.calls(lambda x, w, b, c=config: triton_linear.linear(x, w, b, c))
            ) if ok else math.nan  # fmt: skip
        except Exception as error:
            print(f"error {model} {proj} m={m} {config.short()}: {type(error).__name__}: "
                  f"{str(error)[:200]}")  # fmt: skip
            err, us = math.nan, math.nan
        row = {"model": model, "proj": proj, "n": n, "k": k, "m": m, "config": config.short(),
               "cfg": config.__dict__, "us": us, "rel_err": err}  # fmt: skip
        rows.append(row)
        results["sweep"].append(row)
    timed = [r for r in rows if not math.isnan(r["us"])]
    best = min(timed, key=lambda r: r["us"]) if timed else None
    best_fma = min((r for r in timed if r["cfg"]["kind"] == "fma"), key=lambda r: r["us"],
                   default=None)  # fmt: skip
    best_dot = min((r for r in timed if r["cfg"]["kind"] == "dot"), key=lambda r: r["us"],
                   default=None)  # fmt: skip
    summary = {
        "model": model, "proj": proj, "n": n, "k": k, "m": m, "bias": bias,
        "cublas_us": cublas, "cublas_tbps": tbps(case, cublas),
        "best_us": best["us"] if best else None, "best": best["cfg"] if best else None,
        "best_tbps": tbps(case, best["us"]) if best else None,
        "best_fma_us": best_fma["us"] if best_fma else None,
        "best_fma": best_fma["config"] if best_fma else None,
        "best_dot_us": best_dot["us"] if best_dot else None,
        "best_dot": best_dot["config"] if best_dot else None, "tried": len(rows),
    }  # fmt: skip
    results["best"].append(summary)
    best_text = f"{best['us']:6.1f} {best['config']}" if best else "-"
    print(f"{model} {proj} m={m}: cublas {cublas:6.1f} us, best {best_text} ({len(rows)} tried)")
    del case
    torch.cuda.empty_cache()


def sweep_gated(model: str, n2: int, k: int, m: int, sms: int) -> None:
    """Fused gate_up + SiLU-and-mul vs gate_up (cuBLAS or best Triton) + silu_and_mul."""
    from pagoda_kernels._triton import linear as triton_linear

    case = Case(n2, k, m, False)
    truth = silu_and_mul64(case.truth())
    unfused = graph_us(case.calls(lambda x, w, b: kernels.silu_and_mul(F.linear(x, w))))
    best_linear = next((r for r in results["best"] if r["model"] == model
                        and r["proj"] == "gate_up" and r["m"] == m and r["best"]), None)  # fmt: skip
    unfused_triton = None
    if best_linear:
        config = GemvConfig(**best_linear["best"])
        unfused_triton = graph_us(case.calls(
            lambda x, w, b, c=config: kernels.silu_and_mul(triton_linear.linear(x, w, None, c))
        ))  # fmt: skip
    rows = []
    for config in fma_candidates(m, n2, k, sms, gated=True):
        if out_of_time(20):
            break
        try:
            out = triton_linear.linear_silu_and_mul(case.xs[0], case.weights[0], config)
            err = rel_err(out, truth)
            ok = record_check("gated", err, model=model, m=m, config=config.short())
            calls = case.calls(lambda x, w, b, c=config: triton_linear.linear_silu_and_mul(x, w, c))
            us = graph_us(calls) if ok else math.nan
        except Exception as error:
            print(f"error gated {model} m={m} {config.short()}: {str(error)[:200]}")
            err, us = math.nan, math.nan
        rows.append({"config": config.short(), "cfg": config.__dict__, "us": us})
    timed = [r for r in rows if not math.isnan(r["us"])]
    best = min(timed, key=lambda r: r["us"]) if timed else None
    results["gated"].append({
        "model": model, "n2": n2, "k": k, "m": m, "unfused_cublas_us": unfused,
        "unfused_triton_us": unfused_triton, "best_us": best["us"] if best else None,
        "best": best["cfg"] if best else None, "best_config": best["config"] if best else None,
        "rows": rows,
    })  # fmt: skip
    print(f"gated {model} m={m}: cublas+silu {unfused:6.1f}, triton+silu "
          f"{unfused_triton or math.nan:6.1f}, fused {best['us'] if best else math.nan:6.1f} "
          f"{best['config'] if best else ''}")  # fmt: skip
    del case
    torch.cuda.empty_cache()


def projection_cases(include_lm_head: bool) -> list[tuple[str, str, int, int, bool]]:
    cases = []
    for model in MODELS:
        projections = SHAPES[model]
        for proj, (n, k, bias) in projections.items():
            if proj != "lm_head" or include_lm_head:
                cases.append((model, proj, n, k, bias))
    return cases


def run_sweep(workers: int) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    main_cases = projection_cases(False)
    items = []
    for _, _, n, k, bias in main_cases:
        for m in MS_RUN:
            items += [(m, n, k, bias, c, False) for c in candidates(m, n, k, sms)]
    for model in MODELS:
        n2, k, _ = SHAPES[model]["gate_up"]
        for m in [m for m in MS_RUN if m <= 8]:
            items += [(m, n2, k, False, c, True) for c in fma_candidates(m, n2, k, sms, True)]
    items += [(m, n, k, bias, c, False) for n, k, bias, m, c in check_cases(sms)]
    precompile(items, workers)
    for model, proj, n, k, bias in main_cases:
        for m in MS_RUN:
            if out_of_time(40):
                print(f"out of time: skipped {model} {proj} m={m} and later cases")
                return
            sweep_case(model, proj, n, k, bias, m, sms)
        flush()
    for model in MODELS:
        n2, k, _ = SHAPES[model]["gate_up"]
        for m in [m for m in MS_RUN if m <= 8]:
            if not out_of_time(30):
                sweep_gated(model, n2, k, m, sms)
    flush()
    for model in MODELS:  # LM heads: a few configs only (already near bandwidth in cuBLAS)
        n, k, _ = SHAPES[model]["lm_head"]
        for m in (1, 4, 16):
            if out_of_time(30):
                return
            case = Case(n, k, m, False, max_sets=2)
            cublas = graph_us(case.calls(F.linear), min_launches=8)
            config = _gemv_table.heuristic(m, n, k, sms)
            from pagoda_kernels._triton import linear as triton_linear

            us = graph_us(case.calls(lambda x, w, b, c=config: triton_linear.linear(x, w, b, c)),
                          min_launches=8)  # fmt: skip
            results["best"].append({"model": model, "proj": "lm_head", "n": n, "k": k, "m": m,
                                    "cublas_us": cublas, "cublas_tbps": tbps(case, cublas),
                                    "best_us": us, "best": config.__dict__,
                                    "best_tbps": tbps(case, us)})  # fmt: skip
            print(f"{model} lm_head m={m}: cublas {cublas:.1f} us, {config.short()} {us:.1f} us")
            del case
            torch.cuda.empty_cache()


def suggested_table(margin: float = 0.97) -> dict[str, list]:
    """(N, K) -> [(M, config)] where the best Triton config beat cuBLAS by > 3%."""
    table: dict[str, list] = {}
    for row in results["best"]:
        if row.get("best_us") and row["best_us"] < margin * row["cublas_us"]:
            table.setdefault(f"{row['n']},{row['k']}", []).append([row["m"], row["best"]])
    return table


def run_confirm() -> None:
    """The shipped dispatch (``kernels.linear``) against F.linear, do_bench_cudagraph."""
    from pagoda_kernels.linear import choose_config, choose_gated_config

    for model, proj, n, k, bias in projection_cases(True):
        for m in MS_RUN:
            if out_of_time(20):
                print(f"out of time before {model} {proj} m={m}")
                return
            case = Case(n, k, m, bias, max_sets=2 if proj == "lm_head" else 64)
            config = choose_config(m, n, k, DTYPE, DEVICE)
            out = kernels.linear(case.xs[0], case.weights[0], case.biases[0])
            record_check("dispatch", rel_err(out, case.truth()), model=model, proj=proj, m=m)
            cublas = bench_us(case.calls(F.linear))
            ours = bench_us(case.calls(kernels.linear)) if config else cublas
            row = {"model": model, "proj": proj, "n": n, "k": k, "m": m,
                   "config": config.short() if config else "cublas", "cublas_us": cublas,
                   "us": ours, "cublas_tbps": tbps(case, cublas), "tbps": tbps(case, ours)}  # fmt: skip
            if proj == "gate_up" and m <= _gemv_table.FMA_MAX_M:
                gated = choose_gated_config(m, n, k, DTYPE, DEVICE)
                fused = case.calls(lambda x, w, b: kernels.linear_silu_and_mul(x, w))
                unfused = case.calls(lambda x, w, b: kernels.silu_and_mul(F.linear(x, w)))
                got = kernels.linear_silu_and_mul(case.xs[0], case.weights[0])
                record_check("dispatch_gated", rel_err(got, silu_and_mul64(case.truth())),
                             model=model, m=m)  # fmt: skip
                row.update(gated_config=gated.short() if gated else "unfused",
                           fused_us=bench_us(fused), unfused_cublas_us=bench_us(unfused))  # fmt: skip
            results["confirm"].append(row)
            print(f"{model} {proj} m={m}: cublas {cublas:6.1f} us, linear {ours:6.1f} us "
                  f"[{row['config']}]" + (f", gated fused {row['fused_us']:.1f} vs "
                  f"{row['unfused_cublas_us']:.1f}" if "fused_us" in row else ""))  # fmt: skip
            del case
            torch.cuda.empty_cache()
        flush()


def explore_configs(n: int, k: int, sms: int) -> list[GemvConfig]:
    """Wider/deeper dot tilings for M = 4..16 (not in the first sweep)."""
    configs = []
    for block_n in (64, 128):
        for block_k in (64, 128):
            programs = -(-n // block_n)
            split = 1
            while programs * split < 2 * sms and split * 2 * block_k <= k:
                split *= 2
            for stages in (4, 6):
                for warps in (4, 8):
                    configs.append(GemvConfig("dot", block_n, block_k, split, warps, stages))
    return configs


EXPLORE = [("1.5B", "gate_up"), ("1.5B", "down"), ("7B", "down"), ("8B", "gate_up")]


def run_explore(workers: int) -> None:
    """After the confirmation, if time is left: more dot tilings at M = 4 and 8 (leads)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    items = []
    for model, proj in EXPLORE:
        n, k, bias = SHAPES[model][proj]
        items += [(m, n, k, bias, c, False) for m in (4, 8) for c in explore_configs(n, k, sms)]
    if out_of_time(60):
        return
    precompile(items, workers)
    for model, proj in EXPLORE:
        n, k, bias = SHAPES[model][proj]
        for m in (4, 8):
            if out_of_time(30):
                return
            sweep_case(model, proj, n, k, bias, m, sms, explore_configs(n, k, sms))


def check_cases(sms: int) -> list[tuple[int, int, bool, int, GemvConfig]]:
    return [
        (1536, 8960, False, 1, _gemv_table.heuristic(1, 1536, 8960, sms)),
        (2048, 1536, True, 4, GemvConfig("fma", 2, 512, 4)),
        (1536, 8960, False, 16, GemvConfig("dot", 32, 128, 4, 4, 3)),
        (17920, 1536, False, 2, GemvConfig("fma", 4, 512)),
    ]


def check_graph_and_determinism(sms: int) -> None:
    """Dispatch and split-K under CUDA-graph capture with new inputs, and bitwise repeats."""
    from pagoda_kernels._triton import linear as triton_linear

    for n, k, bias, m, config in check_cases(sms):
        case = Case(n, k, m, bias, max_sets=1)
        x, w, b = case.xs[0], case.weights[0], case.biases[0]
        out = torch.empty(m, n, device=DEVICE, dtype=DTYPE)
        static_x = x.clone()
        triton_linear.launch(static_x, w, b, out, config)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            triton_linear.launch(static_x, w, b, out, config)
            via_dispatch = kernels.linear(static_x, w, b)
        static_x.copy_(torch.randn_like(x))
        out.fill_(math.nan)
        graph.replay()
        truth = static_x.double() @ w.double().T + (b.double() if b is not None else 0)
        record_check("cuda_graph", max(rel_err(out, truth), rel_err(via_dispatch, truth)),
                     n=n, k=k, m=m, config=config.short())  # fmt: skip
        first = triton_linear.linear(x, w, b, config)
        same = all(torch.equal(first, triton_linear.linear(x, w, b, config)) for _ in range(5))
        record_check("deterministic", 0.0 if same else math.inf, n=n, k=k, m=m,
                     config=config.short())  # fmt: skip
    for n, k in ((64, 4096), (3000, 1000)):  # float32 (ieee dot, fma), odd sizes
        for m, config in ((3, GemvConfig("fma", 4, 256, 2)), (9, GemvConfig("dot", 16, 128, 2))):
            x = torch.randn(m, k, device=DEVICE)
            w = torch.randn(n, k, device=DEVICE)
            out = torch.full((m, n), math.nan, device=DEVICE)
            triton_linear.launch(x, w, None, out, config)
            err = rel_err(out, x.double() @ w.double().T)
            ok = err <= 1e-5
            results["checks"].append({"name": "fp32", "rel_err": err, "ok": ok, "n": n, "m": m})
            if not ok:
                print(f"FAIL fp32 n={n} k={k} m={m} {config.short()} rel_err={err:.2e}")


def out_path(args: argparse.Namespace) -> str | None:
    if args.out:
        return args.out
    if os.environ.get("OUT"):
        return os.path.join(os.environ["OUT"], f"gemv_{args.mode}.json")
    return None


_path: str | None = None


def flush() -> None:
    if _path:
        results["suggested_table"] = suggested_table()
        with open(_path, "w") as file:
            json.dump(results, file, indent=1, default=str)


def print_summary(mode: str) -> None:
    failed = [c for c in results["checks"] if not c["ok"]]
    print(f"\nchecks: {len(results['checks']) - len(failed)} passed, {len(failed)} failed")
    for check in failed[:8]:
        print("  FAIL", check)
    if mode == "sweep":
        print("\nGPU us/call, CUDA-graph replay, weights rotated over >= 300 MB; TB/s of bytes")
        print(f"{'case':<18} {'M':>2} {'cuBLAS':>6} {'TB/s':>4} {'triton':>6} {'TB/s':>4} "
              f"{'x':>5} {'best config':<22} {'fma':>6} {'dot':>6}")  # fmt: skip
        for r in results["best"]:
            best = GemvConfig(**r["best"]).short() if r.get("best") else "-"
            ratio = r["cublas_us"] / r["best_us"] if r.get("best_us") else math.nan
            fma = f"{r['best_fma_us']:6.1f}" if r.get("best_fma_us") else "     -"
            dot = f"{r['best_dot_us']:6.1f}" if r.get("best_dot_us") else "     -"
            print(f"{r['model'] + ' ' + r['proj']:<18} {r['m']:>2} {r['cublas_us']:6.1f} "
                  f"{r['cublas_tbps']:4.2f} {r.get('best_us') or math.nan:6.1f} "
                  f"{r.get('best_tbps') or math.nan:4.2f} {ratio:5.2f} {best:<22} {fma} {dot}")  # fmt: skip
        print("\ngated (fused gate_up+silu) us: cublas+silu / triton+silu / fused [config]")
        for g in results["gated"]:
            print(f"{g['model']:<5} m={g['m']} {g['unfused_cublas_us']:6.1f} "
                  f"{g['unfused_triton_us'] or math.nan:6.1f} {g['best_us'] or math.nan:6.1f} "
                  f"{g['best_config']}")  # fmt: skip
    else:
        print("\nGPU us/call, do_bench_cudagraph median, weights rotated over >= 300 MB")
        print(f"{'case':<18} {'M':>2} {'cuBLAS':>6} {'TB/s':>4} {'linear':>6} {'TB/s':>4} "
              f"{'x':>5} {'config':<22} {'fused':>6} {'unfused':>7}")  # fmt: skip
        for r in results["confirm"]:
            fused = f"{r['fused_us']:6.1f} {r['unfused_cublas_us']:7.1f}" if "fused_us" in r else ""
            print(f"{r['model'] + ' ' + r['proj']:<18} {r['m']:>2} {r['cublas_us']:6.1f} "
                  f"{r['cublas_tbps']:4.2f} {r['us']:6.1f} {r['tbps']:4.2f} "
                  f"{r['cublas_us'] / r['us']:5.2f} {r['config']:<22} {fused}")  # fmt: skip
        for r in results["best"]:  # --explore
            print(f"explore {r['model']} {r['proj']} m={r['m']}: cublas {r['cublas_us']:.1f}, "
                  f"best {r.get('best_us') or math.nan:.1f} {r.get('best_dot')}")  # fmt: skip


def main() -> None:
    global deadline, _path
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("sweep", "confirm"), default="confirm")
    parser.add_argument("--out", default=None)
    parser.add_argument("--explore", action="store_true", help="confirm: then try more tilings")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for the run (default 270; --fp8: 220)")
    parser.add_argument("--fp8", action="store_true", help="the FP8 skinny GEMM sweep")
    parser.add_argument("--models", nargs="+", choices=list(SHAPES), default=MODELS)
    parser.add_argument("--ms", nargs="+", type=int, choices=MS, default=list(MS))
    parser.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    gemv_fp8.add_arguments(parser)
    args = parser.parse_args()
    if args.fp8:
        args.budget_s = 220.0 if args.budget_s is None else args.budget_s
        gemv_fp8.run(args)
        return
    deadline = time.monotonic() + (270.0 if args.budget_s is None else args.budget_s)
    MODELS[:] = args.models
    MS_RUN[:] = args.ms
    _path = out_path(args)
    props = torch.cuda.get_device_properties(0)
    results["env"] = {"device": props.name, "sms": props.multi_processor_count,
                      "torch": torch.__version__, "triton": triton.__version__,
                      "mode": args.mode}  # fmt: skip
    print(results["env"])
    sections: list[Callable[[], None]] = [
        (lambda: run_sweep(args.workers)) if args.mode == "sweep" else run_confirm,
        lambda: check_graph_and_determinism(props.multi_processor_count),
    ]
    if args.mode == "confirm" and args.explore:
        sections.append(lambda: run_explore(args.workers))
    for section in sections:
        try:
            section()
        except Exception:
            traceback.print_exc()
            results.setdefault("errors", []).append(traceback.format_exc())
    flush()
    print_summary(args.mode)


if __name__ == "__main__":
    main()
