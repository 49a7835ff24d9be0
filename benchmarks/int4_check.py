"""Int4 (W4A16) decode projections on one GPU: the word GEMV's launch configs against the
first GEMV and the GEMM, next to bf16 ``F.linear`` (cuBLAS) of the same shape.

    python -m benchmarks.int4_check --out $OUT/int4_check.json [--budget-s 200]

For the projections of Qwen2.5-1.5B and Qwen2.5-7B (groups of 128) and M = 1, 2, 4, 8, 16:
every candidate is checked against the float32 reference (NaN-poisoned output) and timed
as the engine's decode graphs see it (``cuda_timing.graph_us``: launches captured in one
CUDA graph, calls rotated over >= 256 MB of weight copies so that L2 never holds them).
Reported: us per call and the weight stream in GB/s. The best word-GEMV launch per case and
what ``words_config_for`` (the shipped choice) picks go to the JSON; a table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
import triton

from benchmarks.cuda_timing import graph_us
from kernels._triton import int4_linear as k4
from kernels.int4_linear import int4_linear_ref

SHAPES = {  # name: (N, K, bias)
    "1.5b.qkv": (2048, 1536, True), "1.5b.o": (1536, 1536, False),
    "1.5b.gate_up": (17920, 1536, False), "1.5b.down": (1536, 8960, False),
    "7b.qkv": (4608, 3584, True), "7b.o": (3584, 3584, False),
    "7b.gate_up": (37888, 3584, False), "7b.down": (3584, 18944, False),
}  # fmt: skip
GROUP = 128
ROTATE_BYTES = 256 << 20


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
        GROUP_SIZE=GROUP, HAS_G_IDX=False, HAS_BIAS=bias is not None, BLOCK_N=32, BLOCK_K=64)


def _gemm(x, q, s, z, bias, out):
    k4.int4_linear(x, q, s, z, GROUP, None, bias, out, gemv=False)


def _dequant_cublas(scratch):
    def run(x, q, s, z, bias, out):
        from kernels.int4_linear import int4_linear

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


def time_case(name: str, m: int, deadline: float) -> dict:
    n, k, has_bias = SHAPES[name]
    copies = max(2, ROTATE_BYTES // (n * k // 2))
    weights = _weights(n, k, copies)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
    q0, s0, z0 = weights[0]
    want = int4_linear_ref(x.float(), q0, s0, z0, GROUP, None, None if bias is None else bias.float())
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    bytes_moved = n * k // 2 + n * (k // GROUP) * 5

    def timed(fn) -> float | None:
        out.fill_(float("nan"))
        fn(x, q0, s0, z0, bias, out)
        err = ((out.float() - want).norm() / want.norm()).item()
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
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "int4_check.json"))
    parser.add_argument("--budget-s", type=float, default=200)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = parser.parse_args()
    start = time.monotonic()
    cases = [(name, m) for m in args.m for name in SHAPES]
    rows = []
    for i, (name, m) in enumerate(cases):
        # An even share of what is left for every case still to come.
        share = (args.budget_s - (time.monotonic() - start)) / (len(cases) - i)
        rows.append(time_case(name, m, time.monotonic() + max(share, 1.0)))
        r = rows[-1]
        print(f"{name:14} M={m:<2} bf16 {r['bf16_us']:7.1f}  first {r['first_gemv_us'] or 0:7.1f}  "
              f"gemm {r['gemm_us'] or 0:7.1f}  dq+cublas {r['dequant_cublas_us'] or 0:7.1f}  shipped {r['shipped']['us'] or 0:7.1f}  "
              f"best {r.get('best', {}).get('us', 0):7.1f} us "
              f"({r.get('best_gb_s', 0):.0f} GB/s) {r.get('best')}", flush=True)  # fmt: skip
    with open(args.out, "w") as f:
        json.dump({"group_size": GROUP, "device": torch.cuda.get_device_name(), "rows": rows}, f,
                  indent=1)  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
