"""Int4 (W4A16) decode projections on one GPU: the word GEMV's launch configs against the
first GEMV and the GEMM, next to bf16 ``F.linear`` (cuBLAS) of the same shape.

    python -m benchmarks.int4_check --out $OUT/int4_check.json [--budget-s 200]

For the projections of Qwen2.5-1.5B and Qwen2.5-7B (groups of 128) and M = 1, 2, 4, 8, 16:
every candidate is checked against the float32 reference (NaN-poisoned output) and timed
as the engine's decode graphs see it (``cuda_timing.graph_us``: launches captured in one
CUDA graph, calls rotated over >= 256 MB of weight copies so that L2 never holds them).
Reported: us per call and the weight stream in GB/s. The best word-GEMV launch per case and
what ``words_config_for`` (the shipped choice) picks go to the JSON; a table is printed last.

The tensor-core GEMV candidate (``int4_gemv_dot``, not dispatched yet) is swept for M in
``--dot-m`` (1, 4, 16) within ``--dot-budget-s`` of its own (compiles included; they run
ahead on all CPU cores): every launch of ``dot_candidates``, then the best one's other
stage counts, then its other dequantization (every code dequantized) and x-sum way. Each
launch's time (NaN where it did not compile, did not fit or was wrong) goes to the JSON's
``dot`` rows with the best, next to the word GEMV's best and bf16; one line per projection
and M is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
import triton

from benchmarks.cuda_timing import graph_us
from pagoda_kernels._triton import int4_linear as k4
from pagoda_kernels.int4_linear import int4_linear_ref

SHAPES = {  # name: (N, K, bias)
    "1.5b.qkv": (2048, 1536, True), "1.5b.o": (1536, 1536, False),
    "1.5b.gate_up": (17920, 1536, False), "1.5b.down": (1536, 8960, False),
    "7b.qkv": (4608, 3584, True), "7b.o": (3584, 3584, False),
    "7b.gate_up": (37888, 3584, False), "7b.down": (3584, 18944, False),
}  # fmt: skip
GROUP = 128
ROTATE_BYTES = 256 << 20
SMS = 132  # the H200's streaming multiprocessors


def _weights(n: int, k: int, copies: int):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    out = []
    for _ in range(copies):
        q = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda",
                          generator=gen)  # fmt: skip
        s = (torch.rand(n, k // GROUP, device="cuda", generator=gen) + 0.5) / 16 / k**0.5
        z = torch.randint(0, 16, (n, k // GROUP), dtype=torch.uint8, device="cuda",
                          generator=gen)  # fmt: skip
        out.append((q, s.contiguous(), z))
    return out


def _first_gemv(x, q, s, z, bias, out):
    n, k = q.shape[0], x.shape[1]
    bias_arg = q if bias is None else bias
    k4._int4_gemv_kernel[(triton.cdiv(n, 32), x.shape[0])](
        x, q, s, z, q, bias_arg, out, n, k, x.stride(0), q.stride(0), s.shape[1],
        GROUP_SIZE=GROUP, HAS_G_IDX=False, HAS_BIAS=bias is not None, BLOCK_N=32, BLOCK_K=64)  # fmt: skip


def _gemm(x, q, s, z, bias, out):
    k4.int4_linear(x, q, s, z, GROUP, None, bias, out, gemv=False)


def _dequant_cublas(scratch):
    def run(x, q, s, z, bias, out):
        from pagoda_kernels.int4_linear import int4_linear

        int4_linear(x, q, s, z, GROUP, None, bias, out, scratch)

    return run


def _words(config):
    def run(x, q, s, z, bias, out):
        k4.int4_gemv_words(x, q, s, z, GROUP, bias, out, config)

    return run


def candidates(m: int):
    rows = 1 if m <= 1 else 2 if m <= 2 else 4
    launches = ((8, 64, 1), (8, 32, 4), (8, 32, 8), (16, 32, 2), (32, 32, 4), (32, 32, 8))
    for block_n, block_w, split in launches:
        yield k4.WordsConfig(block_n, block_w, split, rows, 4)


def _dot(config):
    def run(x, q, s, z, bias, out):
        k4.int4_gemv_dot(x, q, s, z, GROUP, bias, out, config)

    return run


def dot_candidates(n: int, k: int):
    """The tensor-core GEMV's first pass: block_n {64, 128} x block_k {64, 128, 256} x
    num_warps {4, 8} x the two smallest splits of {1, 2, 4, 8} that give >= 2 programs an
    SM (else 4 and 8), 3 stages. block_k above the group size is lowered to it by the
    launcher, so for groups of 128 block_k 256 is 128 and is not timed twice."""
    seen = set()
    for block_n in (64, 128):
        programs = triton.cdiv(n, block_n)
        splits = [s for s in (1, 2, 4, 8) if programs * s >= 2 * SMS][:2] or [4, 8]
        for block_k in (64, 128, 256):
            for split in splits:
                for num_warps in (4, 8):
                    key = (block_n, min(block_k, GROUP), split, num_warps)
                    if key not in seen and k // split >= key[1]:
                        seen.add(key)
                        yield k4.DotConfig(block_n, block_k, split, num_warps, 3)


def dot_refinements(best):
    """After the first pass: the best launch's other stage counts, its every-code
    dequantization and its other way to sum x."""
    auto = "reduce" if best.block_n >= 32 * best.num_warps else "dot"
    x_sum = best.x_sum if best.x_sum != "auto" else auto
    return [
        dataclasses.replace(best, num_stages=2),
        dataclasses.replace(best, num_stages=4),
        dataclasses.replace(best, scale_after=False),
        dataclasses.replace(best, x_sum="dot" if x_sum == "reduce" else "reduce"),
    ]


def _precompile(configs, x, q, s, z, bias, out) -> None:
    """Compile the launches on all CPU cores ahead of timing. Best effort: a launch that
    fails here compiles again (and fails, recorded) when timed."""
    try:
        with (ThreadPoolExecutor(os.cpu_count() or 4) as pool,
              triton.AsyncCompileMode(pool, ignore_errors=True)):  # fmt: skip
            for config in configs:
                try:
                    grid, args, meta = k4.dot_launch(x, q, s, z, GROUP, bias, out, config)
                    k4._int4_gemv_dot_kernel.warmup(*args, grid=grid, **meta)
                except Exception:  # met again (and recorded) when timed
                    pass
    except Exception as e:  # AsyncCompileMode itself
        print(f"  (compiling ahead failed, {type(e).__name__}: {e}; compiling when timed)")


def time_dot(name: str, m: int, words_best_us: float | None, bf16_us: float, timed,
             operands, seconds: float) -> dict:  # fmt: skip
    """The tensor-core GEMV's sweep for one case, within ``seconds`` (compiles included)."""
    start = time.monotonic()
    deadline = start + seconds
    n, k, _ = SHAPES[name]
    bytes_moved = n * k // 2 + n * (k // GROUP) * 5
    row = {"case": name, "m": m, "n": n, "k": k, "bf16_us": bf16_us,
           "words_best_us": words_best_us, "configs": []}  # fmt: skip

    def measure(configs) -> None:
        _precompile(configs, *operands)
        for config in configs:
            if time.monotonic() > deadline:
                row["sweep_cut"] = True
                return
            entry = vars(config).copy()
            try:
                us = timed(_dot(config), entry)
            except Exception as e:  # compile error, out of shared memory, bad config
                us, entry["error"] = None, f"{type(e).__name__}: {str(e)[:200]}"
            entry["us"] = float("nan") if us is None else us
            row["configs"].append(entry)

    measure(list(dot_candidates(n, k)))
    timed_ok = [c for c in row["configs"] if not math.isnan(c["us"])]
    if timed_ok:
        best = min(timed_ok, key=lambda c: c["us"])
        fields = {f.name for f in dataclasses.fields(k4.DotConfig)}
        measure(dot_refinements(k4.DotConfig(**{f: best[f] for f in fields})))
        best = min((c for c in row["configs"] if not math.isnan(c["us"])), key=lambda c: c["us"])
        row["best"] = dict(best)
        row["best_gb_s"] = bytes_moved / best["us"] / 1e3
        if words_best_us:
            row["speedup_vs_words"] = words_best_us / best["us"]
    row["spent_s"] = time.monotonic() - start
    return row


def time_case(name: str, m: int, deadline: float, dot_seconds: float | None = None) -> dict:
    n, k, has_bias = SHAPES[name]
    copies = max(2, ROTATE_BYTES // (n * k // 2))
    weights = _weights(n, k, copies)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
    q0, s0, z0 = weights[0]
    want = int4_linear_ref(x.float(), q0, s0, z0, GROUP, None,
                           None if bias is None else bias.float())  # fmt: skip
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    bytes_moved = n * k // 2 + n * (k // GROUP) * 5

    def timed(fn, entry: dict | None = None) -> float | None:
        out.fill_(float("nan"))
        fn(x, q0, s0, z0, bias, out)
        err = ((out.float() - want).norm() / want.norm()).item()
        if entry is not None:
            entry["err"] = err
        if not err < 2e-2:
            return None
        return graph_us([lambda w=w: fn(x, *w, bias, out) for w in weights])

    row = {"case": name, "m": m, "n": n, "k": k}
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
             for _ in range(max(2, ROTATE_BYTES // (n * k * 2)))]  # fmt: skip
    row["bf16_us"] = graph_us([lambda w=w: F.linear(x, w, bias) for w in dense])
    del dense
    row["first_gemv_us"] = timed(_first_gemv) if m <= 16 else None
    row["gemm_us"] = timed(_gemm)
    row["dequant_cublas_us"] = timed(_dequant_cublas(torch.empty(n * k, dtype=x.dtype,
                                                                 device="cuda")))  # fmt: skip
    shipped = k4.words_config_for(m, n, k)
    row["shipped"] = vars(shipped) | {"us": timed(_words(shipped))}
    best = None
    for config in candidates(m):
        if time.monotonic() > deadline:
            row["sweep_cut"] = True
            break
        us = timed(_words(config))
        if us is not None and (best is None or us < best[1]):
            best = (config, us)
    if best:
        row["best"] = vars(best[0]) | {"us": best[1]}
        row["best_gb_s"] = bytes_moved / best[1] / 1e3
    row["shipped_gb_s"] = bytes_moved / row["shipped"]["us"] / 1e3 if row["shipped"]["us"] else None
    if dot_seconds is not None:
        words_best = row["best"]["us"] if best else None
        row["dot"] = time_dot(name, m, words_best, row["bf16_us"], timed,
                              (x, q0, s0, z0, bias, out), dot_seconds)  # fmt: skip
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    out_default = os.path.join(os.environ.get("OUT", "."), "int4_check.json")
    parser.add_argument("--out", default=out_default)
    parser.add_argument("--budget-s", type=float, default=200)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--dot-m", type=int, nargs="*", default=[1, 4, 16],
                        help="row counts (of --m) to sweep the tensor-core GEMV for")  # fmt: skip
    parser.add_argument("--dot-budget-s", type=float, default=90,
                        help="seconds for the tensor-core GEMV's sweep, compiles included")  # fmt: skip
    args = parser.parse_args()
    start = time.monotonic()
    cases = [(name, m) for m in args.m for name in SHAPES]
    dot_cases = sum(m in args.dot_m for _, m in cases)
    rows, dot_rows, dot_spent = [], [], 0.0
    for i, (name, m) in enumerate(cases):
        # An even share of what is left for every case still to come (the dot sweep: of
        # its own budget, over the cases still to sweep).
        share = (args.budget_s - (time.monotonic() - start)) / (len(cases) - i)
        dot_seconds = None
        if m in args.dot_m:
            dot_seconds = max((args.dot_budget_s - dot_spent) / (dot_cases - len(dot_rows)), 1.0)
        rows.append(time_case(name, m, time.monotonic() + max(share, 1.0), dot_seconds))
        r = rows[-1]
        d = r.pop("dot", None)
        if d is not None:
            dot_rows.append(d)
            dot_spent += d["spent_s"]
        print(f"{name:14} M={m:<2} bf16 {r['bf16_us']:7.1f}  first {r['first_gemv_us'] or 0:7.1f}  "
              f"gemm {r['gemm_us'] or 0:7.1f}  dq+cublas {r['dequant_cublas_us'] or 0:7.1f}  shipped {r['shipped']['us'] or 0:7.1f}  "
              f"best {r.get('best', {}).get('us', 0):7.1f} us "
              f"({r.get('best_gb_s', 0):.0f} GB/s) {r.get('best')}", flush=True)  # fmt: skip
        if d is not None:
            print(f"{name:14} M={m:<2} dot best {d.get('best', {}).get('us', float('nan')):7.1f} us "
                  f"({d.get('best_gb_s', 0):.0f} GB/s) of {len(d['configs'])} launches in "
                  f"{d['spent_s']:.0f} s {d.get('best')}", flush=True)  # fmt: skip
    for m in args.dot_m:
        print(f"tensor-core GEMV, M={m}: best launch per projection (us), word GEMV's best, bf16")
        for d in (d for d in dot_rows if d["m"] == m):
            b = d.get("best", {})
            print(f"  {d['case']:14} M={m:<2} dot {b.get('us', float('nan')):7.1f} "
                  f"({d.get('best_gb_s', 0):4.0f} GB/s)  words {d['words_best_us'] or float('nan'):7.1f}  "
                  f"bf16 {d['bf16_us']:7.1f}  x{d.get('speedup_vs_words', float('nan')):.2f} vs words  "
                  f"{ {f: b[f] for f in ('block_n', 'block_k', 'split', 'num_warps', 'num_stages', 'scale_after', 'x_sum') if f in b} }"
                  f"{'  (sweep cut)' if d.get('sweep_cut') else ''}")  # fmt: skip
    with open(args.out, "w") as f:
        json.dump({"group_size": GROUP, "device": torch.cuda.get_device_name(), "rows": rows,
                   "dot": dot_rows}, f, indent=1)  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
