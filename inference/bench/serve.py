"""``pagoda bench serve``: load any OpenAI-compatible server the way users do.

Open-loop: requests are sent at Poisson arrival times (``--request-rate``, seeded) or all at
once (``inf``), whether or not earlier ones have finished, so a slow server builds a queue
instead of slowing the load down. Every request streams; TTFT, inter-token latency (ITL:
the gap between streamed chunks, as vLLM's bench counts it; a chunk carries several tokens
where drafts were accepted or the server merged the steps queued for a lagging stream),
time per output token (TPOT) and end-to-end latency are measured on the client side, and
token counts come from the server's usage block.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

from inference.bench.common import add_output_args, record, write_results

# Prompt words for text prompts without a tokenizer: common words that are one token with
# their leading space in the usual BPE vocabularies, so the length comes out close.
_WORDS = (
    "the of and to in is was for on that with as by at from his it an are were which be "
    "this has have had not but or its first one new all also two they their been after who "
    "time year more other when into some most over only city about people many such then"
).split()


@dataclass
class BenchRequest:
    prompt: str | list[int]
    input_len: int
    output_len: int


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    start_time: float = 0.0  # wall clock (time.time()) when the request was sent
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def add_bench_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="served model name (default: the first)")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests/s; inf sends all at once"
    )
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument(
        "--num-clients",
        type=int,
        default=1,
        help="client processes sharing the load (round-robin, one clock), so that the "
        "client is not the limit of a burst",
    )
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="sample lengths uniformly in [len*(1-r), len*(1+r)]; 0 keeps them fixed",
    )
    parser.add_argument(
        "--token-ids", action="store_true", help="send prompts as token ids (completions)"
    )
    parser.add_argument(
        "--tokenizer", default=None, help="local tokenizer folder, for exact text lengths"
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=10000,
        help="token ids are drawn below this without --tokenizer (every real vocabulary "
        "is larger than the default)",
    )
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly the output length (vLLM's ignore_eos)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=os.environ.get("PAGODA_API_KEY"))
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    add_output_args(parser)
    parser.add_argument(
        "--save-detailed",
        action="store_true",
        help="also write each request's send time, TTFT, E2E and inter-token gaps to the JSON",
    )
    return parser


# ----- workload --------------------------------------------------------------------------


def _lengths(rng: random.Random, mean: int, ratio: float, count: int) -> list[int]:
    if ratio <= 0:
        return [mean] * count
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(count)]


def _load_tokenizer(path: str | None):
    if path is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _exact_text(tokenizer, rng: random.Random, length: int, usable: list[int]) -> str:
    """Text that the tokenizer encodes to exactly ``length`` tokens (as near as it can)."""
    ids = [rng.choice(usable) for _ in range(length)]
    text = tokenizer.decode(ids)
    for _ in range(10):
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == length:
            break
        if len(encoded) > length:
            encoded = encoded[:length]
        else:
            encoded += [rng.choice(usable) for _ in range(length - len(encoded))]
        text = tokenizer.decode(encoded)
    return text


def build_workload(args: argparse.Namespace) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    inputs = _lengths(rng, args.input_len, args.random_range_ratio, args.num_prompts)
    outputs = _lengths(rng, args.output_len, args.random_range_ratio, args.num_prompts)
    tokenizer = _load_tokenizer(args.tokenizer)
    if tokenizer is not None:
        special = set(tokenizer.all_special_ids)
        usable = [i for i in range(min(len(tokenizer), 200_000)) if i not in special]
    else:
        low = 1000 if args.vocab_size > 4000 else 3  # clear of the usual special ids
        usable = list(range(low, args.vocab_size))
    requests = []
    for input_len, output_len in zip(inputs, outputs, strict=True):
        prompt: str | list[int]
        if args.token_ids:
            prompt = [rng.choice(usable) for _ in range(input_len)]
        elif tokenizer is not None:
            prompt = _exact_text(tokenizer, rng, input_len, usable)
        else:
            prompt = " ".join(rng.choice(_WORDS) for _ in range(input_len))
        requests.append(BenchRequest(prompt, input_len, output_len))
    return requests


def arrival_delays(num: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential gaps (Poisson process) at ``rate``."""
    if math.isinf(rate) or rate <= 0:
        return [0.0] * num
    rng = random.Random(seed + 1)
    return [rng.expovariate(rate) for _ in range(num)]


# ----- client ----------------------------------------------------------------------------


def _payload(args: argparse.Namespace, model: str, request: BenchRequest) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": args.ignore_eos,
    }
    if args.endpoint == "chat":
        content = request.prompt
        if isinstance(content, list):
            raise ValueError("--token-ids needs --endpoint completions")
        payload["messages"] = [{"role": "user", "content": content}]
    else:
        payload["prompt"] = request.prompt
    return payload


def _is_token_chunk(chunk: dict[str, Any]) -> bool:
    """A chunk with a choice carries new tokens (as vLLM's benchmark counts them); its text
    may be empty, e.g. for random weights whose ids the tokenizer cannot render."""
    return bool(chunk.get("choices"))


async def send_request(session, url: str, payload: dict[str, Any], headers) -> RequestResult:
    result = RequestResult(start_time=time.time())
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with session.post(url, json=payload, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw_line in response.content:
                line = raw_line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                    result.output_tokens = chunk["usage"].get("completion_tokens", 0)
                if _is_token_chunk(chunk):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    chunks += 1
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e_s = last - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = chunks > 0
    if not result.ok:
        result.error = "no tokens received"
    return result


async def _resolve_model(session, base_url: str, headers) -> str:
    async with session.get(f"{base_url}/v1/models", headers=headers) as response:
        response.raise_for_status()
        return (await response.json())["data"][0]["id"]


SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")  # fmt: skip


async def _spec_decode_counts(session, base_url: str, headers) -> tuple[float, ...] | None:
    """The server's speculative-decoding counters (summed over label sets) from /metrics;
    None when it exports none (speculation off, or no /metrics)."""
    try:
        async with session.get(f"{base_url}/metrics", headers=headers) as response:
            if response.status != 200:
                return None
            text = await response.text()
    except Exception:  # noqa: BLE001 - a server without /metrics: nothing to report
        return None
    return spec_decode_counts_in(text)


def spec_decode_counts_in(text: str) -> tuple[float, ...] | None:
    """(drafts, draft tokens, accepted tokens) in a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    seen = False
    for family in text_string_to_metric_families(text):
        if family.name in totals:
            seen = True
            totals[family.name] += sum(s.value for s in family.samples
                                       if s.name.endswith("_total"))  # fmt: skip
    return tuple(totals.values()) if seen else None


def spec_decode_fields(before: tuple[float, ...] | None,
                       after: tuple[float, ...] | None) -> dict[str, Any]:  # fmt: skip
    """Acceptance over the measurement, as ``pagoda bench latency|throughput`` report it."""
    if before is None or after is None:
        return {}
    drafts, draft_tokens, accepted = (a - b for a, b in zip(after, before, strict=True))
    return {
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else 1.0,
        "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else 0.0,
        "spec_decode_num_drafts": int(drafts),
        "spec_decode_num_draft_tokens": int(draft_tokens),
    }


def _session(args: argparse.Namespace, max_concurrency: int | None):
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
    return aiohttp.ClientSession(timeout=timeout, connector=connector)


def _headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def _url(args: argparse.Namespace) -> str:
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    return args.base_url.rstrip("/") + path


async def _send_scheduled(
    session, args: argparse.Namespace, model: str, scheduled: list[tuple[BenchRequest, float]],
    start_at: float, max_concurrency: int | None,
) -> list[RequestResult]:
    """Send each request ``offset`` seconds after the wall-clock time ``start_at``."""
    url, headers = _url(args), _headers(args)
    limiter = asyncio.Semaphore(max_concurrency or max(1, len(scheduled)))

    async def one(request: BenchRequest) -> RequestResult:
        async with limiter:
            return await send_request(session, url, _payload(args, model, request), headers)

    tasks = []
    for request, offset in scheduled:
        wait = start_at + offset - time.time()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(request)))
    return list(await asyncio.gather(*tasks))


def _client_process(
    args: argparse.Namespace, model: str, scheduled: list[tuple[BenchRequest, float]],
    start_at: float, max_concurrency: int | None,
) -> tuple[list[RequestResult], float]:
    """One of ``--num-clients`` load processes: its share of the requests, on the shared
    clock; returns the results and the wall time its last one finished."""

    async def run() -> list[RequestResult]:
        async with _session(args, max_concurrency) as session:
            return await _send_scheduled(session, args, model, scheduled, start_at,
                                         max_concurrency)  # fmt: skip

    results = asyncio.run(run())
    return results, time.time()


def _shares(num_clients: int, scheduled: list) -> list[list]:
    """Round-robin: each client gets every ``num_clients``-th request of the schedule."""
    return [scheduled[i::num_clients] for i in range(num_clients) if scheduled[i::num_clients]]


async def run_load(args: argparse.Namespace, requests: list[BenchRequest]):
    num_clients = max(1, getattr(args, "num_clients", 1) or 1)
    async with _session(args, args.max_concurrency) as session:
        base_url, headers = args.base_url.rstrip("/"), _headers(args)
        model = args.model or await _resolve_model(session, base_url, headers)
        # One request first, outside the measurement, so the server's lazy work is done.
        warmup = BenchRequest(requests[0].prompt, requests[0].input_len, 4)
        await send_request(session, _url(args), _payload(args, model, warmup), headers)
        offsets = list(itertools.accumulate(arrival_delays(len(requests), args.request_rate,
                                                           args.seed)))  # fmt: skip
        scheduled = list(zip(requests, offsets, strict=True))
        spec_before = await _spec_decode_counts(session, base_url, headers)
        if num_clients == 1:
            start = time.time()
            results = await _send_scheduled(session, args, model, scheduled, start,
                                            args.max_concurrency)  # fmt: skip
            end = time.time()
        else:
            results, end, start = await _run_clients(args, model, scheduled, num_clients)
        duration = end - start
        spec = spec_decode_fields(spec_before, await _spec_decode_counts(session, base_url,
                                                                          headers))  # fmt: skip
    return model, results, duration, spec


async def _run_clients(args: argparse.Namespace, model: str, scheduled: list, num_clients: int):
    """The schedule spread over ``num_clients`` processes (one Python client's event loop
    tops out at some thousands of streamed tokens a second, below what a burst asks of a
    fast server), all starting on one clock once every process is up."""
    import concurrent.futures
    import multiprocessing

    shares = _shares(num_clients, scheduled)
    concurrency = -(-args.max_concurrency // len(shares)) if args.max_concurrency else None
    context = multiprocessing.get_context("spawn")
    loop = asyncio.get_running_loop()
    with concurrent.futures.ProcessPoolExecutor(len(shares), mp_context=context) as pool:
        # Processes start and import before the clock runs: a start far enough ahead.
        list(pool.map(time.sleep, [0.0] * len(shares)))
        start = time.time() + 1.0
        futures = [loop.run_in_executor(pool, _client_process, args, model, share, start,
                                        concurrency) for share in shares]  # fmt: skip
        done = await asyncio.gather(*futures)
    # Back in the schedule's order.
    results: list[RequestResult | None] = [None] * len(scheduled)
    for index, (share_results, _) in enumerate(done):
        results[index :: len(shares)] = share_results
    return results, max(end for _, end in done), start


# ----- report ----------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without needing numpy."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(
    args: argparse.Namespace, model: str, results: list[RequestResult], duration: float,
    spec: dict[str, Any] | None = None,
) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    series = {
        "ttft": [r.ttft_s for r in done],
        "tpot": [t for r in done if (t := r.tpot_s) is not None],
        "itl": [gap for r in done for gap in r.itl_s],
        "e2e": [r.e2e_s for r in done],
    }
    latency: dict[str, float] = {}
    for name, values in series.items():
        latency[f"{name}_mean_ms"] = round(sum(values) / len(values) * 1000, 3) if values else None
        for q in (50, 90, 99):
            value = percentile(values, q)
            latency[f"{name}_p{q}_ms"] = None if math.isnan(value) else round(value * 1000, 3)
    rate = "inf" if math.isinf(args.request_rate) else args.request_rate
    if getattr(args, "save_detailed", False):
        latency["requests"] = [
            {
                "start_time": round(r.start_time, 6), "ok": r.ok, "error": r.error,
                "output_tokens": r.output_tokens, "ttft_ms": round(r.ttft_s * 1e3, 3),
                "e2e_ms": round(r.e2e_s * 1e3, 3), "itl_ms": [round(g * 1e3, 3) for g in r.itl_s],
            }  # fmt: skip
            for r in results
        ]
    errors = sorted({r.error for r in results if not r.ok})
    return record(
        "serve",
        model=model,
        base_url=args.base_url,
        endpoint=args.endpoint,
        prompt_format="token_ids" if args.token_ids else "text",
        num_prompts=args.num_prompts,
        completed=len(done),
        failed=len(results) - len(done),
        errors=errors[:5],
        input_len=args.input_len,
        output_len=args.output_len,
        random_range_ratio=args.random_range_ratio,
        request_rate=rate,
        max_concurrency=args.max_concurrency,
        num_clients=getattr(args, "num_clients", 1),
        duration_s=round(duration, 3),
        request_throughput=round(len(done) / duration, 3),
        output_tok_s=round(output_tokens / duration, 1),
        total_tok_s=round((prompt_tokens + output_tokens) / duration, 1),
        total_prompt_tokens=prompt_tokens,
        total_output_tokens=output_tokens,
        **(spec or {}),
        **latency,
    )


def print_table(result: dict[str, Any]) -> None:
    rows = [
        ("Successful requests", result["completed"]),
        ("Failed requests", result["failed"]),
        ("Request rate (req/s)", result["request_rate"]),
        ("Duration (s)", result["duration_s"]),
        ("Total prompt tokens", result["total_prompt_tokens"]),
        ("Total output tokens", result["total_output_tokens"]),
        ("Request throughput (req/s)", result["request_throughput"]),
        ("Output throughput (tok/s)", result["output_tok_s"]),
        ("Total throughput (tok/s)", result["total_tok_s"]),
    ]
    print(f"{' Serving benchmark ':=^60}")
    for label, value in rows:
        print(f"{label:<40}{value!s:>20}")
    names = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E latency"}
    print(f"{'(ms)':<20}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key, label in names.items():
        cells = [result[f"{key}_{s}_ms"] for s in ("mean", "p50", "p90", "p99")]
        print(f"{label:<20}" + "".join(f"{'-' if c is None else f'{c:.2f}':>10}" for c in cells))
    if "mean_acceptance_length" in result:
        print(f"{'Mean acceptance length':<40}{result['mean_acceptance_length']:>20}")
        print(f"{'Draft acceptance rate':<40}{result['acceptance_rate']:>20}")
    for error in result["errors"]:
        print(f"error: {error}")
    print("=" * 60)


def run_bench_serve(args: argparse.Namespace) -> int:
    if args.token_ids and args.endpoint == "chat":
        raise ValueError("--token-ids needs --endpoint completions")
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.num_clients < 1:
        raise ValueError("--num-clients must be >= 1")
    requests = build_workload(args)
    model, results, duration, spec = asyncio.run(run_load(args, requests))
    result = summarize(args, model, results, duration, spec)
    print_table(result)
    write_results(args, result)
    return 0 if result["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = add_bench_serve_args(argparse.ArgumentParser(prog="pagoda bench serve"))
    return run_bench_serve(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
