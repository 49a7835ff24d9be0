"""FP8 skinny GEMM sweep (``gemv_check --fp8``): the Triton FP8 kernels' kinds and tilings
against the tuned bf16 path and cuBLASLt's FP8 GEMM, on one GPU.

    python -m benchmarks.gemv_check --fp8 [--out PATH] [--budget-s 230] [--workers 14]

For the Qwen2.5-1.5B and 7B projections (qkv, o, gate_up, down) at M = 1, 2, 4, 8: every
candidate config (``candidates``) is compiled first in parallel worker processes (Triton's
disk cache), then per case checked against the float64 scheme (NaN-poisoned output) and
timed with CUDA-graph replay of calls rotated over >= 300 MB of weight copies (L2 never
holds the weights), next to

- ``bf16``: ``kernels.linear`` on bf16 weights (the tuned bf16 table or cuBLAS),
- ``scaled_mm``: ``torch._scaled_mm`` (row-wise scales) with the activation quantization
  (``kernels.fp8_quant``, one Triton launch) and the bias, i.e. the M > 8 path,
- ``shipped``: ``kernels.fp8_linear`` as dispatched now.

The JSON (``--out``, or ``$OUT/fp8_sweep.json``) holds every timing, the best config per
case and kind, CUDA-graph/determinism checks, and ``fp8_table``: (N, K) -> [[M, config]]
(the best Triton config, or None where ``scaled_mm`` was > 3% faster), in the form
``kernels._gemv_table.fp8_table_from_sweep`` reads (paste its ``table_source`` output, also
printed, into ``FP8_TABLE``). A compact table is printed last.
"""

import argparse
import json
import math
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import triton

import pagoda_kernels as kernels
from benchmarks.cuda_timing import graph_us
from pagoda_kernels import _gemv_table
from pagoda_kernels._float64 import fp8_linear64, rel_err
from pagoda_kernels._gemv_table import GemvConfig

DTYPE = torch.bfloat16
FP8 = torch.float8_e4m3fn
TOLERANCE = 1e-2
ROTATE_BYTES = 300 * 1024 * 1024  # fp8 weights rotated per timing: 5x the 60 MB L2
MS = [1, 2, 4, 8]
# model -> projection -> (N, K, bias)
# (7B first: its batch-1 target is the one FP8 is for, should the budget run out.)
SHAPES: dict[str, dict[str, tuple[int, int, bool]]] = {
    "7B": {"qkv": (4608, 3584, True), "o": (3584, 3584, False),
           "gate_up": (37888, 3584, False), "down": (3584, 18944, False)},
    "1.5B": {"qkv": (2048, 1536, True), "o": (1536, 1536, False),
             "gate_up": (17920, 1536, False), "down": (1536, 8960, False)},
}  # fmt: skip
DEVICE = torch.device("cuda")
results: dict[str, Any] = {"checks": [], "sweep": [], "best": [], "graph": []}
deadline = math.inf


def out_of_time(reserve_s: float = 0.0) -> bool:
    return time.monotonic() > deadline - reserve_s


def _splits(programs: int, k: int, block_k: int, target: int) -> list[int]:
    """1, plus the split-K that brings the programs to ``target`` (and half of it)."""
    split = 1
    while programs * split < target and split * 2 * block_k <= k:
        split *= 2
    return sorted({1, max(1, split // 2), split})


def candidates(m: int, n: int, k: int, sms: int) -> list[GemvConfig]:
    """fma tilings of 16..64 fp8 elements a thread a step (1-4 16-byte loads) and dot
    tilings of 64/128 weight rows, each with in-kernel and separate activation quantization;
    split-K only where the row blocks alone give too few programs (fma: also half of it)."""
    configs = []
    for kind in ("fma", "fmaq"):
        # (4, 512, 2) and (8, 512, 4) give each thread two weight rows of the same 16 K
        # elements: x is converted once for both.
        for block_n, block_k, warps in ((1, 2048, 4), (2, 1024, 4), (4, 512, 4), (4, 512, 2),
                                        (8, 512, 4), (8, 1024, 8)):  # fmt: skip
            if block_k > max(512, triton.next_power_of_2(k)):
                continue
            for split in _splits(-(-n // block_n), k, block_k, 4 * sms):
                configs.append(GemvConfig(kind, block_n, block_k, split, warps))
    for kind in ("dot", "dotq"):
        for block_n, block_k, stages in ((64, 128, 4), (64, 256, 3), (64, 512, 2), (128, 128, 4),
                                         (128, 256, 3)):  # fmt: skip
            split = _splits(-(-n // block_n), k, block_k, 2 * sms)[-1]
            configs.append(GemvConfig(kind, block_n, block_k, split, 4, stages))
    return configs


def _compile_key(m: int, n: int, k: int, bias: bool, config: GemvConfig | None) -> tuple:
    """What Triton compiles separately (constexprs, specialisation), to compile each once;
    ``config`` None: the dispatched bf16 and FP8 paths of the case."""
    if config is None:
        return ("dispatch", m, n, k, bias)
    split = max(1, min(config.split_k, -(-k // config.block_k)))
    per = triton.cdiv(triton.cdiv(k, split), config.block_k) * config.block_k
    rows = 1 if m <= 1 else 2 if m <= 2 else 4 if m <= 4 else 8
    return (config.kind, config.block_n, config.block_k, config.num_warps, config.num_stages,
            -(-k // per) > 1, k % per == 0, bias, rows if config.kind.startswith("fma") else 0,
            k % 16 == 0)  # fmt: skip


def operands(m: int, n: int, k: int, bias: bool, seed: int = 0):
    """x (bf16), per-channel fp8 weight + scale (rows of different sizes), bias."""
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, k, device=DEVICE, generator=generator).to(DTYPE)
    weight = torch.randn(n, k, device=DEVICE, generator=generator) / k**0.5
    weight *= torch.logspace(-1, 0, n, device=DEVICE)[:, None]
    scale = weight.abs().amax(dim=1) / 448.0
    quantized = (weight / scale[:, None]).to(FP8)
    b = torch.randn(n, device=DEVICE, generator=generator).to(DTYPE) if bias else None
    return x, quantized, scale, b


def _compile_worker(items: list[tuple]) -> int:
    """Run each (m, n, k, bias, config) once so its kernels land in the disk cache (config
    None: ``kernels.linear`` in bf16 and ``kernels.fp8_linear``, as dispatched)."""
    from pagoda_kernels._triton import fp8_linear as triton_fp8

    done = 0
    for m, n, k, bias, config in items:
        try:
            x, w, s, b = operands(m, n, k, bias)
            if config is None:
                kernels.linear(x, w.to(DTYPE), b)
                kernels.fp8_linear(x, w, s, b)
            else:
                out = torch.empty(m, n, device=DEVICE, dtype=DTYPE)
                triton_fp8.launch(x, w, s, b, out, config)
            done += 1
        except Exception as error:  # reported again (with the case) in the main process
            name = config.short() if config else "dispatch"
            print(f"compile failed {name} m={m} n={n} k={k}: {error}"[:300])
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    return done


def precompile(items: list[tuple], workers: int) -> None:
    unique: dict[tuple, tuple] = {}
    for item in items:
        unique.setdefault(_compile_key(*item), item)
    todo = list(unique.values())
    started = time.monotonic()
    compiled = -1
    if workers <= 0:
        compiled = _compile_worker(todo)
    else:
        chunks = [todo[i::workers] for i in range(workers)]
        context = multiprocessing.get_context("spawn")
        with context.Pool(workers) as pool:
            pending = pool.map_async(_compile_worker, [c for c in chunks if c])
            try:
                budget = max(10.0, deadline - time.monotonic() - 120)
                compiled = sum(pending.get(timeout=budget))
            except multiprocessing.TimeoutError:
                print("precompile timed out; the rest compiles on first use")
                pool.terminate()
    elapsed = time.monotonic() - started
    print(f"precompiled {compiled}/{len(todo)} kernels in {elapsed:.0f} s ({workers} processes)",
          flush=True)  # fmt: skip
    results["precompile"] = {"kernels": len(todo), "ok": compiled, "s": elapsed}


class Case:
    """fp8 weight copies (>= ROTATE_BYTES in all), bf16 copies for the bf16 path, inputs."""

    def __init__(self, n: int, k: int, m: int, bias: bool) -> None:
        self.n, self.k, self.m = n, k, m
        self.sets = max(2, min(64, -(-ROTATE_BYTES // (n * k))))
        ops = [operands(m, n, k, bias, seed=i) for i in range(self.sets)]
        self.xs = [o[0] for o in ops]
        self.weights = [o[1] for o in ops]
        self.scales = [o[2] for o in ops]
        self.biases = [o[3] for o in ops]
        bf16_sets = max(2, min(64, -(-ROTATE_BYTES // (2 * n * k))))
        self.bf16 = [(self.xs[i], (self.weights[i].float() * self.scales[i][:, None]).to(DTYPE),
                      self.biases[i]) for i in range(bf16_sets)]  # fmt: skip
        self.bytes = n * k + 2 * m * (k + n) + 4 * n + (2 * n if bias else 0)
        self.truth = fp8_linear64(self.xs[0], self.weights[0], self.scales[0], self.biases[0])

    def calls(self, fn: Callable[..., Any]) -> list[Callable[[], Any]]:
        return [
            lambda x=x, w=w, s=s, b=b: fn(x, w, s, b)
            for x, w, s, b in zip(self.xs, self.weights, self.scales, self.biases, strict=True)
        ]


time_us = graph_us  # the CPU test replaces the timer


def scaled_mm(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None):
    """cuBLASLt's FP8 GEMM with the one-launch activation quantization, + bias."""
    from pagoda_kernels.fp8_quant import quantize_per_token

    x_q, x_scale = quantize_per_token(x)
    out = torch._scaled_mm(x_q, w.t(), scale_a=x_scale, scale_b=s[None, :], out_dtype=DTYPE)
    return out + b if b is not None else out


def record_check(name: str, err: float, **info: Any) -> bool:
    ok = err <= TOLERANCE
    results["checks"].append({"name": name, "rel_err": err, "ok": ok, **info})
    if not ok:
        print(f"FAIL {name} {info} rel_err={err:.2e}")
    return ok


def _baseline(
    name: str, case: Case, calls: list[Callable[[], Any]], check: Callable[..., Any] | None
) -> float | None:
    """Time a rival path (after checking it against float64 when ``check`` is given); None
    where it fails (e.g. ``_scaled_mm`` on a device without FP8)."""
    try:
        if check is not None:
            out = check(case.xs[0], case.weights[0], case.scales[0], case.biases[0])
            if not record_check(name, rel_err(out, case.truth), n=case.n, k=case.k, m=case.m):
                return None
        return time_us(calls)
    except Exception as error:
        print(f"{name} failed n={case.n} k={case.k} m={case.m}: {str(error)[:200]}")
        return None


def sweep_case(model: str, proj: str, n: int, k: int, bias: bool, m: int, sms: int) -> None:
    from pagoda_kernels._triton import fp8_linear as triton_fp8

    case = Case(n, k, m, bias)
    x, w, s, b = case.xs[0], case.weights[0], case.scales[0], case.biases[0]
    bf16_calls = [lambda x=x, w=w, b=b: kernels.linear(x, w, b) for x, w, b in case.bf16]
    bf16 = _baseline("bf16", case, bf16_calls, None)
    smm = _baseline("scaled_mm", case, case.calls(scaled_mm), scaled_mm)
    shipped = _baseline("shipped", case, case.calls(kernels.fp8_linear), kernels.fp8_linear)
    rows = []
    for config in candidates(m, n, k, sms):
        if out_of_time(30):
            break
        try:
            out = torch.full((m, n), math.nan, device=DEVICE, dtype=DTYPE)
            triton_fp8.launch(x, w, s, b, out, config)
            err = rel_err(out, case.truth)
            ok = record_check("fp8", err, model=model, proj=proj, m=m, config=config.short())
            us = time_us(case.calls(
                lambda x, w, s, b, c=config: triton_fp8.fp8_linear(x, w, s, b, c)
            )) if ok else math.nan  # fmt: skip
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
    by_kind = {}
    for kind in ("fma", "fmaq", "dot", "dotq"):
        fastest = min((r for r in timed if r["cfg"]["kind"] == kind), key=lambda r: r["us"],
                      default=None)  # fmt: skip
        by_kind[kind] = [fastest["us"], fastest["config"]] if fastest else None
    summary = {
        "model": model, "proj": proj, "n": n, "k": k, "m": m, "bias": bias,
        "bf16_us": bf16, "scaled_mm_us": smm, "shipped_us": shipped,
        "best_us": best["us"] if best else None, "best": best["cfg"] if best else None,
        "best_tbps": case.bytes / best["us"] / 1e6 if best else None,
        "by_kind": by_kind, "tried": len(rows),
    }  # fmt: skip
    results["best"].append(summary)
    print(f"{model} {proj} m={m}: bf16 {_us(bf16)} scaled_mm {_us(smm)} shipped {_us(shipped)}"
          f" best {_us(summary['best_us'])} {best['config'] if best else '-'} "
          f"({len(rows)} tried)", flush=True)  # fmt: skip
    del case
    torch.cuda.empty_cache()


def _us(value: float | None) -> str:
    return f"{value:6.1f}" if value is not None and not math.isnan(value) else "     -"


def check_graph_and_determinism(sms: int) -> None:
    """Each kind with split-K under CUDA-graph capture (new inputs after capture) and
    bitwise repeats; the dispatch too."""
    from pagoda_kernels._triton import fp8_linear as triton_fp8

    cases = [(3584, 18944, False, 1, GemvConfig("fma", 4, 512, 4)),
             (4608, 3584, True, 3, GemvConfig("fmaq", 2, 1024, 2)),
             (3584, 18944, False, 2, GemvConfig("dot", 64, 256, 4, 4, 3)),
             (2048, 1536, True, 8, GemvConfig("dotq", 64, 128, 2, 4, 4))]  # fmt: skip
    for n, k, bias, m, config in cases:
        x, w, s, b = operands(m, n, k, bias, seed=7)
        static_x = x.clone()
        out = torch.empty(m, n, device=DEVICE, dtype=DTYPE)
        triton_fp8.launch(static_x, w, s, b, out, config)
        kernels.fp8_linear(static_x, w, s, b)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            triton_fp8.launch(static_x, w, s, b, out, config)
            via_dispatch = kernels.fp8_linear(static_x, w, s, b)
        static_x.copy_(torch.randn_like(x))
        out.fill_(math.nan)
        graph.replay()
        truth = fp8_linear64(static_x, w, s, b)
        ok = record_check("cuda_graph", max(rel_err(out, truth), rel_err(via_dispatch, truth)),
                          n=n, k=k, m=m, config=config.short())  # fmt: skip
        first = triton_fp8.fp8_linear(x, w, s, b, config)
        same = all(torch.equal(first, triton_fp8.fp8_linear(x, w, s, b, config)) for _ in range(5))
        record_check("deterministic", 0.0 if same else math.inf, n=n, k=k, m=m,
                     config=config.short())  # fmt: skip
        results["graph"].append({"config": config.short(), "m": m, "ok": ok and same})


def fp8_table(margin: float = 0.97) -> dict[str, list]:
    """(N, K) -> [[M, config or None]]: the best Triton config, or None (cuBLASLt's
    ``_scaled_mm``) where that was faster than 1 / ``margin`` x the Triton best. The bf16
    path is context (other weights), not a choice of the FP8 dispatch."""
    table: dict[str, list] = {}
    for row in results["best"]:
        best, rival = row.get("best_us"), row.get("scaled_mm_us")
        if best is None and rival is None:
            continue
        use_triton = best is not None and (rival is None or best < rival / margin)
        table.setdefault(f"{row['n']},{row['k']}", []).append(
            [row["m"], row["best"] if use_triton else None]
        )
    return table


_path: str | None = None


def flush() -> None:
    results["fp8_table"] = fp8_table()
    if _path:
        with open(_path, "w") as file:
            json.dump(results, file, indent=1, default=str)


def _layers() -> dict[tuple[str, int], list[dict]]:
    """(model, M) -> the four projections' summaries, where all four were measured."""
    layers: dict[tuple[str, int], list[dict]] = {}
    for row in results["best"]:
        layers.setdefault((row["model"], row["m"]), []).append(row)
    return {key: rows for key, rows in layers.items() if len(rows) == len(SHAPES[key[0]])}


def print_summary() -> None:
    failed = [c for c in results["checks"] if not c["ok"]]
    print(f"\nchecks: {len(results['checks']) - len(failed)} passed, {len(failed)} failed")
    for check in failed[:8]:
        print("  FAIL", check)
    print("\nGPU us/call, CUDA-graph replay, weights rotated over >= 300 MB; TB/s of fp8 bytes")
    print(f"{'case':<14} {'M':>2} {'bf16':>6} {'s_mm':>6} {'ship':>6} {'best':>6} {'TB/s':>4} "
          f"{'x bf16':>6} {'best config':<22} {'fma':>6} {'fmaq':>6} {'dot':>6} {'dotq':>6}")  # fmt: skip
    for r in results["best"]:
        best = GemvConfig(**r["best"]).short() if r.get("best") else "-"
        ratio = r["bf16_us"] / r["best_us"] if r.get("best_us") and r.get("bf16_us") else math.nan
        kinds = " ".join(_us(v[0] if v else None) for v in r["by_kind"].values())
        print(f"{r['model'] + ' ' + r['proj']:<14} {r['m']:>2} {_us(r['bf16_us'])} "
              f"{_us(r['scaled_mm_us'])} {_us(r['shipped_us'])} {_us(r['best_us'])} "
              f"{r.get('best_tbps') or math.nan:4.2f} {ratio:6.2f} {best:<22} {kinds}")  # fmt: skip
    print("\nper decoder layer (qkv + o + gate_up + down), us: bf16 / scaled_mm / best FP8")
    for (model, m), rows in _layers().items():
        sums = [sum(r[key] for r in rows) if all(r.get(key) for r in rows) else None
                for key in ("bf16_us", "scaled_mm_us", "best_us")]  # fmt: skip
        print(f"{model:<5} M={m}: {' / '.join(_us(v).strip() for v in sums)}")
        results.setdefault("layers", []).append({"model": model, "m": m, "bf16_us": sums[0],
                                                 "scaled_mm_us": sums[1], "best_us": sums[2]})  # fmt: skip
    print("\nFP8_TABLE entries (pagoda_kernels/_gemv_table.py):")
    print(_gemv_table.table_source(_gemv_table.fp8_table_from_sweep(results)))


def run(args: argparse.Namespace) -> None:
    global deadline, _path
    deadline = time.monotonic() + args.budget_s
    _path = args.out or (os.path.join(os.environ["OUT"], "fp8_sweep.json")
                         if os.environ.get("OUT") else None)  # fmt: skip
    if DEVICE.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        name, sms = props.name, props.multi_processor_count
    else:
        name, sms = "cpu", 132
    results["env"] = {"device": name, "sms": sms, "torch": torch.__version__,
                      "triton": triton.__version__, "mode": "fp8", "ms": args.fp8_ms}  # fmt: skip
    print(results["env"], flush=True)
    cases = [(model, proj, *shape) for model in args.fp8_models
             for proj, shape in SHAPES[model].items()]  # fmt: skip
    try:
        items = [(m, n, k, bias, c) for _, _, n, k, bias in cases for m in args.fp8_ms
                 for c in [None, *candidates(m, n, k, sms)]]  # fmt: skip
        try:
            precompile(items, args.workers)
        except Exception:  # the cases compile on first use instead
            traceback.print_exc()
        for model, proj, n, k, bias in cases:
            for m in args.fp8_ms:
                if out_of_time(40):
                    print(f"out of time: skipped {model} {proj} m={m} and later cases")
                    break
                sweep_case(model, proj, n, k, bias, m, sms)
            flush()
    except Exception:
        traceback.print_exc()
        results.setdefault("errors", []).append(traceback.format_exc())
    if DEVICE.type == "cuda":
        try:
            check_graph_and_determinism(sms)
        except Exception:
            traceback.print_exc()
            results.setdefault("errors", []).append(traceback.format_exc())
    print_summary()
    flush()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fp8-models", dest="fp8_models", nargs="+", choices=list(SHAPES),
                        default=list(SHAPES))  # fmt: skip
    parser.add_argument("--fp8-ms", dest="fp8_ms", nargs="+", type=int, choices=MS, default=MS)
