"""Check every Triton kernel against float64 and time the main ones, on one GPU.

    PYTHONUNBUFFERED=1 python3 -m benchmarks.kernel_check [--no-sweep] [--budget-s 380]

Part 1 compares each kernel with a float64 ground truth over a shape grid (head 64/128,
block sizes 1..256, batch 1..256, contexts up to 4096; outputs poisoned with NaN first).
Part 2 times decode and prefill attention in the Qwen2.5-1.5B and -7B shapes and the
elementwise ops with ``triton.testing.do_bench`` (median, L2 flushed between calls),
next to a torch peer, and reports GB/s against the H200's ~4.2 TB/s copy bandwidth.
FP8 KV caches (``kv_cache_dtype="fp8"``) are checked the same way (against float64 over the
dequantized cache; the writes bit-exact against the reference quantization) and decode
attention over them is timed beside bf16's.
Part 3 (unless --no-sweep) times tiling variants of attention. The summary table is
printed last; with ``OUT`` set, everything goes to ``$OUT/kernel_check.json``.

``--long`` replaces parts 2 and 3 with long context (issue #32's rows): decode at batch 1
and 16 over 8k and 32k contexts and prefill of 8k and 32k prompts, next to torch's flash
SDPA, then their tiling variants (KV splits up to 256, query/key tiles, warps, stages).
``--compare-with FILE`` times the same default launches with another copy of
``pagoda_kernels/_triton/attention.py`` (a previous commit's) in the same call.
"""

import argparse
import json
import math
import os
import random
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.testing

from pagoda_kernels import (
    fused_add_rms_norm,
    paged_attention,
    rms_norm,
    rotary_embedding,
    rotary_embedding_with_kv_cache,
    silu_and_mul,
    write_kv_cache,
)
from pagoda_kernels._float64 import attention64, rel_err, rms_norm64, rotary64, silu_and_mul64
from pagoda_kernels._triton import attention as triton_attention
from pagoda_kernels.kv_cache import (
    FP8_KV_DTYPE,
    dequantize_kv_ref,
    quantize_kv_ref,
    write_kv_cache_ref,
)

PEAK_GBPS = 4200.0
TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 1e-2}
SHAPES = {"1.5B": (12, 2), "7B": (28, 4)}  # (q heads, kv heads), head size 128
DEVICE = torch.device("cuda")
results: dict[str, list[dict[str, Any]]] = {"checks": [], "timings": [], "sweeps": []}
deadline = math.inf


def out_of_time() -> bool:
    return time.monotonic() > deadline


def attention_batch(
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    min_cache_bytes: int = 0,
    kv_fp8: bool = False,
) -> dict[str, torch.Tensor]:
    """Random inputs; blocks scattered over a shuffled pool (at least min_cache_bytes).
    ``kv_fp8``: the caches in float8_e4m3fn with scales, as the engine writes them."""
    blocks_per_seq = [-(-length // block_size) for length in context_lens]
    cache_bits = 8 if kv_fp8 else torch.finfo(dtype).bits
    block_bytes = 2 * block_size * num_kv_heads * head_size * cache_bits // 8
    num_blocks = max(sum(blocks_per_seq), min_cache_bytes // block_bytes) + 1
    pool = torch.randperm(num_blocks, device=DEVICE)
    tables = torch.zeros(len(context_lens), max(blocks_per_seq), dtype=torch.int32, device=DEVICE)
    used = 0
    for seq, count in enumerate(blocks_per_seq):
        tables[seq, :count] = pool[used : used + count]
        used += count
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    cumulative = torch.tensor([0, *query_lens]).cumsum(0)
    if kv_fp8:
        scales = {"k_scale": 0.02, "v_scale": 0.01}
        scales = {name: torch.tensor([value], device=DEVICE) for name, value in scales.items()}
        caches = {
            "k_cache": quantize_kv_ref(torch.randn(shape, device=DEVICE) * 4, scales["k_scale"]),
            "v_cache": quantize_kv_ref(torch.randn(shape, device=DEVICE), scales["v_scale"]),
        }
    else:
        scales = {}
        caches = {name: torch.randn(shape, device=DEVICE, dtype=dtype)
                  for name in ("k_cache", "v_cache")}  # fmt: skip
    return {
        "q": torch.randn(sum(query_lens), num_heads, head_size, device=DEVICE, dtype=dtype),
        **caches,
        **scales,
        "block_tables": tables,
        "seq_lens": torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
        "query_start_loc": cumulative.to(device=DEVICE, dtype=torch.int32),
    }


def mix(kind: str, batch: int, max_context: int) -> tuple[list[int], list[int]]:
    """Query and context lengths for a decode, prefill or mixed (chunked) batch."""
    if kind == "decode":
        contexts = [random.randint(1, max_context) for _ in range(batch)]
        return [1] * batch, contexts
    if kind == "prefill":
        queries = [random.randint(1, max_context) for _ in range(batch)]
        return queries, queries
    queries, contexts = [], []
    for seq in range(batch):
        query = 1 if seq % 2 else random.randint(2, 256)
        queries.append(query)
        contexts.append(query + random.randint(0, max_context - query))
    return queries, contexts


def record_check(name: str, err: float, tolerance: float, **info: Any) -> None:
    ok = err <= tolerance
    results["checks"].append({"name": name, "rel_err": err, "tol": tolerance, "ok": ok, **info})
    print(f"{'ok  ' if ok else 'FAIL'} {name} {info} rel_err={err:.2e} (tol {tolerance:.0e})")


def check_attention(
    kind: str, batch: int, max_context: int, head_size: int, block_size: int, dtype: torch.dtype,
    kv_fp8: bool = False, **tiling: Any,
) -> None:  # fmt: skip
    num_heads, num_kv_heads = SHAPES["1.5B"] if head_size == 128 else (8, 2)
    inputs = attention_batch(
        *mix(kind, batch, max_context), num_heads, num_kv_heads, head_size, block_size, dtype,
        kv_fp8=kv_fp8,
    )  # fmt: skip
    scale = head_size**-0.5
    call = triton_attention.paged_attention if tiling else paged_attention
    out = call(**inputs, scale=scale, out=torch.full_like(inputs["q"], math.nan), **tiling)
    # The truth reads the cache as stored: an FP8 cache dequantized exactly.
    truth_inputs = {key: value for key, value in inputs.items() if not key.endswith("_scale")}
    for name in ("k_cache", "v_cache") if kv_fp8 else ():
        truth_inputs[name] = dequantize_kv_ref(inputs[name], inputs[name[0] + "_scale"])
    err = rel_err(out, attention64(**truth_inputs, scale=scale))
    record_check(
        "paged_attention_fp8kv" if kv_fp8 else "paged_attention", err, TOLERANCE[dtype],
        kind=kind, batch=batch, ctx=max_context, head=head_size, block=block_size,
        dtype=str(dtype).removeprefix("torch."), **tiling,
    )  # fmt: skip


def check_fp8_cache_writes(tokens: int, block_size: int) -> None:
    """Both cache writes into FP8 caches: the bytes of the reference quantization."""
    num_kv_heads, num_blocks = 2, 2 * tokens // block_size + 2
    shape = (num_blocks, block_size, num_kv_heads, 128)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[::5] = -1
    key, value = (torch.randn(tokens, num_kv_heads, 128, device=DEVICE,
                              dtype=torch.bfloat16) * 30 for _ in "kv")  # fmt: skip
    k_scale, v_scale = (torch.tensor([s], device=DEVICE) for s in (0.05, 0.02))
    caches = [torch.zeros(shape, device=DEVICE, dtype=FP8_KV_DTYPE) for _ in range(4)]
    write_kv_cache(key, value, caches[0], caches[1], slots, k_scale, v_scale)
    write_kv_cache_ref(key, value, caches[2], caches[3], slots, k_scale, v_scale)
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in ((caches[0], caches[2]), (caches[1], caches[3])))  # fmt: skip
    record_check("write_kv_cache_fp8", 0.0 if same else math.inf, 0.0, tokens=tokens,
                 block=block_size)  # fmt: skip
    q = torch.randn(tokens, 4, 128, device=DEVICE, dtype=torch.bfloat16)
    positions = torch.randint(0, 4096, (tokens,), device=DEVICE)
    for cache in caches:
        cache.zero_()
    _, out_k = rotary_embedding_with_kv_cache(positions, q, key.clone(), value,
                                              rope_cache(4096, 128), caches[0], caches[1],
                                              slots, k_scale, v_scale)  # fmt: skip
    write_kv_cache_ref(out_k, value, caches[2], caches[3], slots, k_scale, v_scale)
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in ((caches[0], caches[2]), (caches[1], caches[3])))  # fmt: skip
    record_check("rotary_with_kv_cache_fp8", 0.0 if same else math.inf, 0.0, tokens=tokens,
                 block=block_size)  # fmt: skip


def check_cuda_graph() -> None:
    """Decode attention captured once in a CUDA graph, replayed on new contents."""
    # Contexts of 300 tokens give every sequence its blocks; the replay shortens them
    # (a longer one would read past its block table's row).
    inputs = attention_batch([1] * 8, [300] * 8, 12, 2, 128, 16, torch.bfloat16)
    out = torch.empty_like(inputs["q"])
    paged_attention(**inputs, scale=0.1, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(**inputs, scale=0.1, out=out)
    inputs["q"].normal_()
    inputs["seq_lens"].copy_(torch.randint(1, 301, (8,), device=DEVICE, dtype=torch.int32))
    out.fill_(math.nan)
    graph.replay()
    record_check("cuda_graph_decode", rel_err(out, attention64(**inputs, scale=0.1)), 1e-2)


def check_elementwise(dtype: torch.dtype) -> None:
    tolerance = TOLERANCE[dtype]
    name = str(dtype).removeprefix("torch.")
    for tokens, hidden in ((1, 1536), (257, 3584), (4096, 1536)):
        x = torch.randn(tokens, hidden, device=DEVICE, dtype=dtype)
        residual = torch.randn_like(x)
        weight = 1 + 0.1 * torch.randn(hidden, device=DEVICE, dtype=dtype)
        err = rel_err(rms_norm(x, weight, 1e-6), rms_norm64(x, weight, 1e-6))
        record_check("rms_norm", err, tolerance, tokens=tokens, hidden=hidden, dtype=name)
        truth = rms_norm64(x.double() + residual.double(), weight, 1e-6)
        out, summed = fused_add_rms_norm(x, residual.clone(), weight, 1e-6)
        err = max(rel_err(out, truth), rel_err(summed, x.double() + residual.double()))
        record_check("fused_add_rms_norm", err, tolerance, tokens=tokens, hidden=hidden, dtype=name)
    for tokens, width in ((3, 8960), (1024, 18944)):
        x = torch.randn(tokens, 2 * width, device=DEVICE, dtype=dtype)
        err = rel_err(silu_and_mul(x), silu_and_mul64(x))
        record_check("silu_and_mul", err, tolerance, tokens=tokens, width=width, dtype=name)
    cache = rope_cache(4096, 128)
    for (num_heads, num_kv_heads), tokens in ((SHAPES["1.5B"], 5), (SHAPES["7B"], 2048)):
        qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * 128, device=DEVICE, dtype=dtype)
        q, k, v = (
            part.view(tokens, -1, 128)
            for part in qkv.split([num_heads * 128, num_kv_heads * 128, num_kv_heads * 128], -1)
        )
        positions = torch.randint(0, 4096, (tokens,), device=DEVICE)
        truth_q, truth_k = rotary64(positions, q, cache), rotary64(positions, k, cache)
        out_q, out_k = rotary_embedding(positions, q, k, cache)
        err = max(rel_err(out_q, truth_q), rel_err(out_k, truth_k))
        record_check("rotary_embedding", err, tolerance, tokens=tokens, heads=num_heads, dtype=name)
        for block_size in (1, 16, 256):
            check_cache_write(tokens, num_kv_heads, block_size, dtype, positions, cache)


def check_cache_write(
    tokens: int,
    num_kv_heads: int,
    block_size: int,
    dtype: torch.dtype,
    positions: torch.Tensor,
    cache: torch.Tensor,
) -> None:
    num_blocks = 2 * tokens // block_size + 2
    shape = (num_blocks, block_size, num_kv_heads, 128)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[::5] = -1
    written = slots >= 0
    key, value = (torch.randn(tokens, num_kv_heads, 128, device=DEVICE, dtype=dtype) for _ in "kv")
    k_cache, v_cache = (torch.full(shape, math.nan, device=DEVICE, dtype=dtype) for _ in "kv")
    write_kv_cache(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = (c.view(-1, num_kv_heads, 128) for c in (k_cache, v_cache))
    exact = torch.equal(flat_k[slots[written]], key[written]) and torch.equal(
        flat_v[slots[written]], value[written]
    )
    untouched = flat_k.isnan().all(-1).all(-1).sum().item() == flat_k.shape[0] - written.sum()
    record_check("write_kv_cache", 0.0 if exact and untouched else math.inf, 0.0,
                 tokens=tokens, block=block_size, dtype=str(dtype).removeprefix("torch."))  # fmt: skip
    q = torch.randn(tokens, num_kv_heads * 2, 128, device=DEVICE, dtype=dtype)
    k = torch.randn(tokens, num_kv_heads, 128, device=DEVICE, dtype=dtype)
    truth_k = rotary64(positions, k, cache)
    k_cache.fill_(math.nan)
    _, out_k = rotary_embedding_with_kv_cache(
        positions, q, k, value, cache, k_cache, v_cache, slots
    )
    err = max(rel_err(out_k, truth_k), rel_err(flat_k[slots[written]], truth_k[written]))
    record_check("rotary_with_kv_cache", err, TOLERANCE[dtype], tokens=tokens, block=block_size)


def rope_cache(max_position: int, head_size: int) -> torch.Tensor:
    inv_freq = 1e6 ** -(torch.arange(0, head_size, 2, device=DEVICE).float() / head_size)
    angles = torch.arange(max_position, device=DEVICE).float()[:, None] * inv_freq[None]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


ROTATE_BYTES = 256 * 1024 * 1024  # inputs rotated through per timing: > 4x the 60 MB L2
MAX_SETS = 16


def num_sets(bytes_per_call: int) -> int:
    """Input sets to rotate through so that timed calls do not hit a warm L2."""
    return max(1, min(MAX_SETS, ROTATE_BYTES // max(bytes_per_call, 1)))


def bench_graph(calls: list[Callable[[], Any]]) -> float:
    """GPU milliseconds per call: all calls (one per input set) captured in one CUDA graph,
    replayed under do_bench (median, L2 flushed between replays). Launch overhead, which
    the engine removes with CUDA graphs too, is excluded."""
    for call in calls:
        call()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=50, return_mode="median")
    return ms / len(calls)


def eager_ms(call: Callable[[], Any], repeats: int = 100) -> float:
    """Wall time per call launched back to back without a graph: max(host, GPU) cost."""
    call()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3 / repeats


def record_timing(
    name: str,
    ms: float,
    bytes_moved: int,
    peer_ms: float | None = None,
    eager: float | None = None,
    **info: Any,
) -> None:
    gbps = bytes_moved / ms / 1e6
    row = {"name": name, "ms": ms, "GB/s": gbps, "pct_peak": 100 * gbps / PEAK_GBPS, **info}
    row.update(peer_ms=peer_ms, eager_ms=eager)
    results["timings"].append(row)
    peer = f" peer {peer_ms * 1e3:7.1f} us" if peer_ms is not None else ""
    host = f" eager {eager * 1e3:7.1f} us" if eager is not None else ""
    print(f"time {name:<22} {info} {ms * 1e3:8.1f} us {gbps:7.0f} GB/s{peer}{host}")


def attention_sets(
    query_len: int, context: int, batch: int, shape: str, kv_fp8: bool = False
) -> tuple[list[dict[str, torch.Tensor]], int]:
    """Input sets sharing one KV pool, each reading different blocks; and KV bytes a call."""
    num_heads, num_kv_heads = SHAPES[shape]
    kv_bytes = 2 * batch * context * num_kv_heads * 128 * (1 if kv_fp8 else 2)
    count = num_sets(kv_bytes)
    base = attention_batch(
        [query_len] * batch, [context] * batch, num_heads, num_kv_heads, 128, 16,
        torch.bfloat16, min_cache_bytes=count * kv_bytes, kv_fp8=kv_fp8,
    )  # fmt: skip
    pool = base["k_cache"].shape[0]
    used = base["block_tables"].numel()
    sets = []
    for _ in range(count):
        tables = torch.randperm(pool, device=DEVICE)[:used].view_as(base["block_tables"])
        sets.append({**base, "block_tables": tables.to(torch.int32), "q": base["q"].clone()})
    return sets, kv_bytes


def sdpa_peer(query_len: int, context: int, batch: int, shape: str, causal: bool) -> float | None:
    """torch SDPA (flash backend) over contiguous K/V of the same size: the bar to meet."""
    num_heads, num_kv_heads = SHAPES[shape]
    bf16 = dict(device=DEVICE, dtype=torch.bfloat16)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = []
    for _ in range(num_sets(2 * batch * context * num_kv_heads * 128 * 2)):
        keys = torch.randn(batch, num_kv_heads, context, 128, **bf16)
        values = torch.randn_like(keys)
        query = torch.randn(batch, num_heads, query_len, 128, **bf16)
        calls.append(
            lambda q=query, k=keys, v=values: sdpa(q, k, v, is_causal=causal, enable_gqa=True)
        )
    try:
        return bench_graph(calls)
    except RuntimeError as error:
        print(f"sdpa peer unavailable: {error}")
        return None


def time_attention(
    kind: str, shape: str, batch: int, context: int, peer: bool = True, kv_fp8: bool = False,
    **tiling: int,
) -> float:  # fmt: skip
    """Decode (one query a sequence) or prefill (query = context) attention, bf16 queries
    over a bf16 (or ``kv_fp8``: float8_e4m3fn) cache."""
    query_len = 1 if kind == "decode" else context
    sets, kv_bytes = attention_sets(query_len, context, batch, shape, kv_fp8)
    call = triton_attention.paged_attention if tiling else paged_attention
    scale = 128**-0.5
    calls = [
        lambda s=s: call(**s, scale=scale, out=torch.empty_like(s["q"]), **tiling) for s in sets
    ]
    ms = bench_graph(calls)
    if tiling:
        return ms
    num_heads = SHAPES[shape][0]
    qo_bytes = 2 * 2 * batch * query_len * num_heads * 128
    info: dict[str, Any] = {"shape": shape, "batch": batch, "ctx": context}
    if kind == "prefill":
        flops = 4 * batch * num_heads * 128 * context * (context + 1) / 2
        info["TFLOPs"] = round(flops / ms / 1e9, 1)
    peer_ms = sdpa_peer(query_len, context, batch, shape, kind == "prefill") if peer else None
    name = f"{kind}_attention" + ("_fp8kv" if kv_fp8 else "")
    record_timing(name, ms, kv_bytes + qo_bytes, peer_ms, eager_ms(calls[0]), **info)
    return ms


def time_elementwise(tokens: int) -> None:
    """The per-layer small ops in the Qwen2.5-1.5B shape, at ``tokens`` tokens."""
    bf16 = dict(device=DEVICE, dtype=torch.bfloat16)
    count = num_sets(tokens * 2 * 8960 * 2)
    weight = torch.randn(1536, **bf16)
    xs = [torch.randn(tokens, 1536, **bf16) for _ in range(2 * count)]
    calls = [
        lambda x=x, r=r: fused_add_rms_norm(x, r, weight, 1e-6)
        for x, r in zip(xs[0::2], xs[1::2], strict=True)
    ]
    peers = [lambda x=x, r=r: torch.nn.functional.rms_norm(x + r, (1536,), weight, 1e-6)
             for x, r in zip(xs[0::2], xs[1::2], strict=True)]  # fmt: skip
    record_timing("fused_add_rms_norm", bench_graph(calls), 4 * tokens * 1536 * 2,
                  bench_graph(peers), eager_ms(calls[0]), tokens=tokens)  # fmt: skip
    gate_ups = [torch.randn(tokens, 2 * 8960, **bf16) for _ in range(count)]
    calls = [lambda g=g: silu_and_mul(g) for g in gate_ups]
    peers = [lambda g=g: torch.nn.functional.silu(g[:, :8960]) * g[:, 8960:] for g in gate_ups]
    record_timing("silu_and_mul", bench_graph(calls), 3 * tokens * 8960 * 2,
                  bench_graph(peers), eager_ms(calls[0]), tokens=tokens)  # fmt: skip
    cache = rope_cache(4096, 128)
    positions = torch.randint(0, 4096, (tokens,), device=DEVICE)
    qkvs = [torch.randn(tokens, 16 * 128, **bf16) for _ in range(count)]
    views = [[t.view(tokens, -1, 128) for t in qkv.split([1536, 256, 256], -1)] for qkv in qkvs]
    calls = [lambda q=q, k=k: rotary_embedding(positions, q, k, cache) for q, k, _ in views]
    record_timing("rotary_embedding", bench_graph(calls), 2 * 2 * tokens * 14 * 128,
                  None, eager_ms(calls[0]), tokens=tokens)  # fmt: skip
    k_cache = torch.randn(count * (tokens // 16 + 1), 16, 2, 128, **bf16)
    v_cache = torch.randn_like(k_cache)
    slots = [torch.randperm(k_cache.shape[0] * 16, device=DEVICE)[:tokens] for _ in range(count)]
    calls = [lambda k=k, v=v, s=s: write_kv_cache(k, v, k_cache, v_cache, s)
             for (_, k, v), s in zip(views, slots, strict=True)]  # fmt: skip
    record_timing("write_kv_cache", bench_graph(calls), 2 * 2 * 2 * tokens * 256,
                  None, eager_ms(calls[0]), tokens=tokens)  # fmt: skip
    calls = [lambda q=q, k=k, v=v, s=s: rotary_embedding_with_kv_cache(
                 positions, q, k, v, cache, k_cache, v_cache, s)
             for (q, k, v), s in zip(views, slots, strict=True)]  # fmt: skip
    # q and k read and written, v read, k and v written to the cache: 34 head rows.
    record_timing("rotary_with_kv_cache", bench_graph(calls), 34 * 256 * tokens,
                  None, eager_ms(calls[0]), tokens=tokens)  # fmt: skip


def sweep() -> None:
    """Tiling variants (GPU time, graphs), so that defaults follow measurements."""
    for shape, batch, context in (("1.5B", 1, 4096), ("1.5B", 64, 2048), ("7B", 64, 1024),
                                  ("1.5B", 256, 1024)):  # fmt: skip
        for segments in (1, 2, 4, 8, 16, 32, 64):
            run_variant("decode", (shape, batch, context), dict(num_segments=segments))
        for tile_n, num_warps, num_stages in ((32, 4, 3), (64, 4, 2), (128, 4, 3), (64, 8, 3)):
            tiling = dict(tile_n=tile_n, num_warps=num_warps, num_stages=num_stages)
            run_variant("decode", (shape, batch, context), tiling)
    for shape, seqs in (("1.5B", 16), ("7B", 4), ("1.5B", 1)):
        for block_m, tile_n, num_warps in ((64, 64, 4), (64, 32, 4), (128, 32, 4), (128, 64, 8)):
            tiling = dict(block_m=block_m, tile_n=tile_n, num_warps=num_warps)
            run_variant("prefill", (shape, seqs, 512), tiling)


def run_variant(kind: str, case: tuple, tiling: dict) -> None:
    if out_of_time():
        return
    try:
        ms = time_attention(kind, *case, peer=False, **tiling)
    except Exception as error:  # a variant may not fit in shared memory
        ms = math.nan
        print(f"variant {kind} {case} {tiling} failed: {type(error).__name__}: {error}")
    results["sweeps"].append({"kind": kind, "case": list(case), **tiling, "ms": ms})
    print(f"sweep {kind} {case} {tiling} {ms * 1e3:.1f} us")


LONG_CASES = (("1.5B", 1, 8192), ("1.5B", 1, 32768), ("7B", 1, 32768))


def load_attention_module(path: str) -> Any:
    """Another copy of the attention kernels, imported under its own name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("attention_compared", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_attention_with(module: Any, kind: str, shape: str, batch: int, context: int) -> float:
    """GPU ms of ``module``'s default launch (its own heuristics) for the case."""
    query_len = 1 if kind == "decode" else context
    sets, _ = attention_sets(query_len, context, batch, shape)
    calls = [lambda s=s: module.paged_attention(**s, scale=128**-0.5, out=torch.empty_like(s["q"]))
             for s in sets]  # fmt: skip
    return bench_graph(calls)


def long_timings(compare_with: str | None) -> None:
    other = load_attention_module(compare_with) if compare_with else None
    cases = [("decode", *case) for case in LONG_CASES] + [("decode", "1.5B", 16, 32768)]
    cases += [("prefill", *case) for case in LONG_CASES]
    for kind, shape, batch, context in cases:
        if out_of_time():
            return
        ms = time_attention(kind, shape, batch, context)
        if other is not None:
            before = time_attention_with(other, kind, shape, batch, context)
            results["timings"][-1]["compared_ms"] = before
            print(f"compare {kind} {shape} b{batch} ctx {context}: {before * 1e3:.1f} us with "
                  f"{compare_with}, {ms * 1e3:.1f} us now ({before / ms:.2f}x)")  # fmt: skip


def long_sweep() -> None:
    """Tilings for long context: the defaults follow these measurements."""
    for shape, batch, context in (*LONG_CASES, ("1.5B", 16, 32768)):
        for segments in (8, 16, 32, 64, 128, 256):
            if segments * batch > 512:
                continue
            for tile_n, num_warps, num_stages in ((64, 4, 2), (128, 4, 2), (64, 8, 3)):
                tiling = dict(num_segments=segments, tile_n=tile_n, num_warps=num_warps,
                              num_stages=num_stages)  # fmt: skip
                run_variant("decode", (shape, batch, context), tiling)
    for shape, batch, context in LONG_CASES:
        for block_m, tile_n, num_warps, num_stages in (
            (64, 32, 4, 3), (128, 32, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 2),
            (128, 128, 8, 2), (64, 64, 4, 3), (256, 64, 8, 2),
        ):  # fmt: skip
            tiling = dict(block_m=block_m, tile_n=tile_n, num_warps=num_warps,
                          num_stages=num_stages, num_segments=1)  # fmt: skip
            run_variant("prefill", (shape, batch, context), tiling)


PER_HEAD_CASES = (("1.5B", 1, 8192), ("1.5B", 1, 32768), ("7B", 1, 32768), ("1.5B", 16, 512),
                  ("7B", 8, 512))


def per_head_sweep() -> None:
    """Prefill tiles of the GQA group (padded to a power of two) against tiles of one query
    head, at the large-tile sizes (steps of 4k+ tokens); the default and SDPA beside."""
    for kind, batch, block_size in (("prefill", 3, 16), ("mixed", 9, 16), ("prefill", 4, 32)):
        for dtype in (torch.bfloat16, torch.float32):
            check_attention(kind, batch, 4096, 128, block_size, dtype, per_head=True)
    check_attention("mixed", 9, 3000, 128, 16, torch.bfloat16, kv_fp8=True, per_head=True)
    for shape, batch, context in PER_HEAD_CASES:
        if out_of_time():
            return
        time_attention("prefill", shape, batch, context)
        for per_head in (False, True):
            for block_m, tile_n, num_warps, num_stages in (
                (128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3),
                (256, 64, 8, 2),
            ):  # fmt: skip
                tiling = dict(block_m=block_m, tile_n=tile_n, num_warps=num_warps,
                              num_stages=num_stages, num_segments=1, per_head=per_head)
                run_variant("prefill", (shape, batch, context), tiling)


def correctness(quick: bool) -> None:
    random.seed(0)
    torch.manual_seed(0)
    decode_batches = {1: 1, 16: 7, 32: 64, 64: 256, 128: 33, 256: 2}  # block size -> batch
    for head_size in (128, 64):
        for block_size, batch in decode_batches.items():
            check_attention("decode", batch, 4096, head_size, block_size, torch.bfloat16)
            check_attention("mixed", 12, 4096, head_size, block_size, torch.bfloat16)
        if quick:
            break
    for dtype in (torch.float32, torch.float16):
        for kind, batch, context in (("decode", 5, 4096), ("prefill", 3, 700), ("mixed", 9, 3000)):
            check_attention(kind, batch, context, 128, 16, dtype)
    check_attention("prefill", 4, 1024, 64, 256, torch.bfloat16)
    check_attention("decode", 256, 1024, 128, 16, torch.float32)
    for kind, batch, context, block_size in (("decode", 64, 4096, 16), ("decode", 3, 4096, 1),
                                             ("mixed", 9, 3000, 16), ("prefill", 3, 700, 32)):
        check_attention(kind, batch, context, 128, block_size, torch.bfloat16, kv_fp8=True)
    check_attention("mixed", 9, 3000, 128, 16, torch.float32, kv_fp8=True)
    for tokens, block_size in ((7, 16), (300, 1), (4096, 16)):
        check_fp8_cache_writes(tokens, block_size)
    check_cuda_graph()
    for dtype in (torch.bfloat16, torch.float32):
        check_elementwise(dtype)


def timings() -> None:
    for shape in SHAPES:
        for batch in (1, 64, 256):
            for context in (512, 1024, 2048, 4096):
                time_attention("decode", shape, batch, context)
                if context in (1024, 2048):  # the FP8 cache beside it (issue 17: 256 x 2k)
                    time_attention("decode", shape, batch, context, peer=False, kv_fp8=True)
        for seqs in (1, 4, 16):
            time_attention("prefill", shape, seqs, 512)
    for tokens in (1, 256, 4096):
        time_elementwise(tokens)


def summary() -> None:
    failed = [c for c in results["checks"] if not c["ok"]]
    print(f"\nchecks: {len(results['checks']) - len(failed)} passed, {len(failed)} failed")
    for check in failed[:10]:
        print("  FAIL", check)
    print("\nGPU time from CUDA-graph replays; eager = back-to-back launches without a graph")
    header = f"{'op':<20} {'case':<26} {'us':>7} {'GB/s':>6} {'%peak':>5} {'peer us':>7}"
    print(f"{header} {'eager us':>8} {'TFLOP/s':>7}")
    for row in results["timings"]:
        case = ",".join(
            f"{k}={v}" for k, v in row.items() if k in ("shape", "batch", "ctx", "tokens")
        )
        peer = f"{row['peer_ms'] * 1e3:7.1f}" if row.get("peer_ms") else "      -"
        eager = f"{row['eager_ms'] * 1e3:8.1f}" if row.get("eager_ms") else "       -"
        print(f"{row['name']:<20} {case:<26} {row['ms'] * 1e3:7.1f} {row['GB/s']:6.0f} "
              f"{row['pct_peak']:5.1f} {peer} {eager} {row.get('TFLOPs', ''):>7}")  # fmt: skip


def main() -> None:
    global deadline
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--quick", action="store_true", help="fewer correctness shapes")
    parser.add_argument("--budget-s", type=float, default=380.0)
    parser.add_argument("--long", action="store_true", help="long-context timings and sweep")
    parser.add_argument("--compare-with", help="another attention.py to time beside (--long)")
    parser.add_argument("--per-head", action="store_true",
                        help="prefill tiles of one query head against the GQA group's only")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    props = torch.cuda.get_device_properties(0)
    results["env"] = {"device": props.name, "sms": props.multi_processor_count,
                      "torch": torch.__version__, "triton": triton.__version__}  # fmt: skip
    print(results["env"])
    if args.per_head:
        later = (per_head_sweep,)
    elif args.long:
        later = (lambda: long_timings(args.compare_with), *(() if args.no_sweep else (long_sweep,)))
    else:
        later = (timings, *(() if args.no_sweep else (sweep,)))
    for section in (lambda: correctness(args.quick), *later):
        started = time.monotonic()
        try:
            section()
        except Exception:
            traceback.print_exc()
            results.setdefault("errors", []).append(traceback.format_exc())
        print(f"-- section done in {time.monotonic() - started:.0f} s")
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "kernel_check.json"), "w") as file:
                json.dump(results, file, indent=1)
    summary()


if __name__ == "__main__":
    main()
