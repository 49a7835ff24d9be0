"""Prefill attention of a long query: the paged Triton kernel against the SDPA path
(``pagoda_kernels.attention.LongPrefill``: context gathered from the cache, torch SDPA),
on one GPU, in the same call, with the largest difference between the two.

    PYTHONUNBUFFERED=1 python3 -m benchmarks.long_prefill_check [--output-json FILE]

Rows: one sequence of ``queries`` tokens over ``context`` tokens of context (a prompt
from scratch when equal, a later chunk of a chunked prefill otherwise), alone and beside
64 decoding sequences of 4k context (a mixed step); the 1.5B's and the 7B's attention
shapes (12/2 and 28/4 heads of 128), bf16, block size 16. Times are eager GPU time per
call (``triton.testing.do_bench``, median).
"""

import argparse
import json

import torch
import triton.testing

from pagoda_kernels import paged_attention
from pagoda_kernels.attention import (
    LongPrefill,
    _sdpa_mode,
    _sdpa_prefill,
    _SdpaMode,
    find_long_prefills,
)

SHAPES = {"1.5b": (12, 2), "7b": (28, 4)}
CASES = [(1024, 1024), (2048, 2048), (2048, 8192), (4096, 4096), (8192, 8192),
         (4096, 32768), (16384, 16384), (16384, 32768)]
# A chunk over earlier context, each way SDPA may run it (``_SdpaMode.over_context``).
WAYS = ("cudnn", "flash", "lower_right")
BLOCK = 16


def _batch(shape: str, queries: int, context: int, decodes: int) -> dict:
    heads, kv_heads = SHAPES[shape]
    device = torch.device("cuda")
    lens = [4096] * decodes + [context]
    query_lens = [1] * decodes + [queries]
    blocks = [-(-n // BLOCK) for n in lens]
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks):
        table[i, :n] = torch.randperm(n) + start
        start += n
    bf16 = dict(device=device, dtype=torch.bfloat16)
    loc = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    return {
        "q": torch.randn(sum(query_lens), heads, 128, **bf16),
        "k_cache": torch.randn(start, BLOCK, kv_heads, 128, **bf16),
        "v_cache": torch.randn(start, BLOCK, kv_heads, 128, **bf16),
        "block_tables": table.to(device),
        "seq_lens": torch.tensor(lens, dtype=torch.int32, device=device),
        "query_start_loc": loc.to(device),
        "host": (loc.numpy(), torch.tensor(lens).numpy()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-json")
    args = parser.parse_args()
    rows = []
    print(f"{'shape':>5} {'decodes':>7} {'queries':>7} {'context':>7} {'paged ms':>9} "
          f"{'sdpa ms':>8} {'speed-up':>8} {'max diff':>9}")
    for shape, (heads, kv_heads) in SHAPES.items():
        mode = _sdpa_mode(torch.device("cuda"), torch.bfloat16, heads, kv_heads, 128)
        print(f"{shape}: SDPA {mode}")
        for decodes in (0, 64):
            for queries, context in CASES:
                batch = _batch(shape, queries, context, decodes)
                host = batch.pop("host")
                prefills = find_long_prefills(*host, queries, 0)
                assert prefills == (LongPrefill(decodes, decodes, queries, context),)
                batch["scale"] = 128**-0.5

                def run_paged(b=batch, n=queries):
                    return paged_attention(**b, max_query_len=n)

                def run_sdpa(b=batch, p=prefills):
                    return paged_attention(**b, long_prefills=p)

                diff = (run_paged().float() - run_sdpa().float()).abs().max().item()
                paged_ms = triton.testing.do_bench(run_paged, warmup=5, rep=40,
                                                   return_mode="median")
                sdpa_ms = triton.testing.do_bench(run_sdpa, warmup=5, rep=40,
                                                  return_mode="median")
                rows.append(dict(shape=shape, decodes=decodes, queries=queries, context=context,
                                 paged_ms=round(paged_ms, 4), sdpa_ms=round(sdpa_ms, 4),
                                 max_abs_diff=diff, sdpa_mode=str(mode)))
                print(f"{shape:>5} {decodes:>7} {queries:>7} {context:>7} {paged_ms:>9.3f} "
                      f"{sdpa_ms:>8.3f} {paged_ms / sdpa_ms:>7.2f}x {diff:>9.2e}", flush=True)
                del batch
    ways = []
    for shape in SHAPES:
        for queries, context in [c for c in CASES if c[0] < c[1]]:
            batch = _batch(shape, queries, context, 0)
            out = torch.empty_like(batch["q"])
            for way in WAYS:
                mode = _SdpaMode(False, way)

                def run(m=mode, b=batch, n=context, o=out):
                    _sdpa_prefill(b["q"], b["k_cache"], b["v_cache"], b["block_tables"][0], n,
                                  128**-0.5, None, None, o, m)

                try:
                    run()
                    ms = triton.testing.do_bench(run, warmup=5, rep=40, return_mode="median")
                except (RuntimeError, NotImplementedError) as error:
                    print(f"{shape} {queries} over {context} {way}: {str(error)[:120]}")
                    continue
                ways.append(dict(shape=shape, queries=queries, context=context, way=way,
                                 ms=round(ms, 4)))
                print(f"{shape:>5} {queries:>6} over {context:>6} {way:>12}: {ms:.3f} ms",
                      flush=True)
            del batch
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "ways": ways}, f,
                      indent=1)


if __name__ == "__main__":
    main()
