"""Prefix-aware routing against round-robin, on localhost: a multi-turn chat workload through
`pagoda router` in front of several `pagoda serve` engines (CPU, prefix caching on).

Each conversation opens with a document of its own and asks a question per turn, every turn
sending the whole conversation so far; a few conversations run at once, each turn after the
previous one's answer. Per routing policy it reports the engines' prefix-cache hit rate
(``vllm:prefix_cache_hits`` over ``vllm:prefix_cache_queries``, summed over the engines, for
this run alone) and the time to first token that the client sees, for first turns and for
the later turns that a cache can serve. Each policy's run uses conversations of its own, so
no run finds what another left in the caches.

    python scripts/router_bench.py --engines 3 --conversations 9 --turns 4 --out RESULTS.json

``--scenario cold-start`` measures a start from zero instead: a request held by the router
while its engine starts, answered once the engine is up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def free_ports(count: int, start: int) -> list[int]:
    return list(range(start, start + count))


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'operator'}", "OMP_NUM_THREADS": "1"}
    handle = log.open("w")
    return subprocess.Popen([PYTHON, "-m", "inference.cli", *args], env=env, stdout=handle,
                            stderr=subprocess.STDOUT, cwd=ROOT)  # fmt: skip


async def wait_ready(url: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{url}/ready")).status_code == 200:
                    return
            await asyncio.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout:.0f}s")


async def cache_counters(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    async with httpx.AsyncClient(timeout=10) as client:
        for url in urls:
            for line in (await client.get(f"{url}/metrics")).text.splitlines():
                name = line.split("{", 1)[0].split(" ", 1)[0]
                if name == "vllm:prefix_cache_hits_total":
                    hits += float(line.rsplit(" ", 1)[1])
                elif name == "vllm:prefix_cache_queries_total":
                    queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def opening(run: str, conversation: int, words: int) -> str:
    facts = " ".join(f"Note {i} of file {run}-{conversation}: item {i * 7 % 97} is blue."
                     for i in range(words // 10))  # fmt: skip
    return f"Read this file, then answer questions about it.\n{facts}"


async def one_turn(client: httpx.AsyncClient, model: str, messages: list, max_tokens: int) -> float:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "temperature": 0}  # fmt: skip
    start = time.perf_counter()
    first = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and first is None and '"content"' in line:
                first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start


async def conversation(client, model, run, index, turns, words, max_tokens, ttfts) -> None:
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": opening(run, index, words) + "\nWhat is item 3?"}]
    for turn in range(turns):
        ttfts.append((turn, await one_turn(client, model, messages, max_tokens)))
        messages += [{"role": "assistant", "content": "Blue."},
                     {"role": "user", "content": f"And item {turn + 4}?"}]  # fmt: skip


async def run_policy(args, policy: str, engines: list[str], port: int, repeat: int) -> dict:
    log = Path(args.logs) / f"router-{policy}.log"
    backends = [arg for url in engines for arg in ("--backend", url)]
    router = spawn(["router", *backends, "--port", str(port), "--policy", policy], log)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(url, 60)
        before = await cache_counters(engines)
        ttfts: list[tuple[int, float]] = []
        limit = asyncio.Semaphore(args.concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]

            async def limited(index: int) -> None:
                async with limit:
                    run = f"{policy}-{repeat}"
                    await conversation(client, model, run, index, args.turns, args.words,
                                       args.max_tokens, ttfts)  # fmt: skip

            started = time.perf_counter()
            await asyncio.gather(*(limited(i) for i in range(args.conversations)))
            elapsed = time.perf_counter() - started
        after = await cache_counters(engines)
    finally:
        router.terminate()
        router.wait(timeout=30)
    hits, queries = after[0] - before[0], after[1] - before[1]
    later = [t for turn, t in ttfts if turn > 0]
    first = [t for turn, t in ttfts if turn == 0]
    return {
        "policy": policy,
        "requests": len(ttfts),
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "ttft_first_turn_mean_s": statistics.mean(first),
        "ttft_later_turns_mean_s": statistics.mean(later) if later else None,
        "ttft_later_turns_p50_s": statistics.median(later) if later else None,
        "ttft_all_mean_s": statistics.mean(t for _, t in ttfts),
        "wall_s": elapsed,
    }


async def cold_start(args) -> dict:
    """Scale from zero on localhost: a request reaches the router while no engine runs; the
    engine starts only then (as KEDA would start a replica on the router's held-request
    gauge), and the request is answered once the engine is up."""
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    engine_port, router_port = args.base_port, args.base_port + 1
    engine_url, url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{router_port}"
    router = spawn(["router", "--backend", f"{args.served_name}={engine_url}", "--port",
                    str(router_port), "--cold-start-timeout", "600", "--scrape-interval", "0.5"],
                   Path(args.logs) / "router-cold.log")  # fmt: skip
    engine = None
    try:
        await wait_ready_or_503(url)
        async with httpx.AsyncClient(base_url=url, timeout=900) as client:
            messages = [{"role": "user", "content": "Say hello."}]
            body = {"model": args.served_name, "messages": messages, "max_tokens": 4}
            started = time.perf_counter()
            answer = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            while "pagoda_router_held_requests{" not in (await client.get("/metrics")).text:
                await asyncio.sleep(0.1)
            held_after = time.perf_counter() - started
            serve = ["serve", args.model, "--device", "cpu", "--port", str(engine_port),
                     "--served-model-name", args.served_name, "--max-model-len", "2048"]
            engine = spawn(serve, Path(args.logs) / "engine-cold.log")
            engine_started = time.perf_counter()
            await wait_ready(engine_url)
            engine_ready = time.perf_counter() - engine_started
            response = await answer
            total = time.perf_counter() - started
        return {"scenario": "cold-start", "status": response.status_code,
                "held_after_s": held_after, "engine_start_to_ready_s": engine_ready,
                "request_to_answer_s": total}  # fmt: skip
    finally:
        for process in (router, engine):
            if process is not None:
                process.terminate()
                process.wait(timeout=60)


async def wait_ready_or_503(url: str) -> None:
    """The router is up (its /ready is 503 until an engine answers)."""
    async with httpx.AsyncClient(timeout=5) as client:
        for _ in range(600):
            with contextlib.suppress(httpx.HTTPError):
                await client.get(f"{url}/health")
                return
            await asyncio.sleep(0.1)


async def main_async(args) -> list[dict]:
    if args.scenario == "cold-start":
        result = await cold_start(args)
        print(json.dumps(result), flush=True)
        return [result]
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    ports = free_ports(args.engines + 1, args.base_port)
    engines, processes = [], []
    try:
        for index, port in enumerate(ports[:-1]):
            serve = ["serve", args.model, "--device", "cpu", "--port", str(port),
                     "--enable-prefix-caching", "--max-model-len", "4096", "--max-num-seqs", "8"]
            processes.append(spawn(serve, Path(args.logs) / f"engine-{index}.log"))
            engines.append(f"http://127.0.0.1:{port}")
        await asyncio.gather(*(wait_ready(url) for url in engines))
        results = []
        for repeat in range(args.repeats):
            for policy in args.policies.split(","):
                result = await run_policy(args, policy, engines, ports[-1], repeat)
                result["repeat"] = repeat
                print(json.dumps(result), flush=True)
                results.append(result)
        return results
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=["affinity", "cold-start"], default="affinity")
    parser.add_argument("--model", default="default")
    parser.add_argument("--served-name", default="smollm2",
                        help="the cold-start engine's model name")
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=9)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--words", type=int, default=300, help="words in each opening document")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--policies", default="round-robin,prefix")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--base-port", type=int, default=18200)
    parser.add_argument("--logs", default="/tmp/router-bench")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
