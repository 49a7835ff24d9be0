"""How many streamed tokens a second one API process serves, with an engine that is never
the limit.

    python -m benchmarks.api_check [--num-prompts 512] [--output-len 128] [--num-clients 3]

The server is the real one (``build_app``, ``AsyncLLMEngine``, the engine process, uvicorn),
but its engine makes tokens without a model: every step gives each running completion its
next token of a fixed text (a real tokenizer's ids, so the server's detokenizers do their
usual work), at once. The load is ``pagoda bench serve`` from ``--num-clients`` processes, a
burst of ``--num-prompts`` streamed completions. Reported: output tokens a second, the API
process's CPU time per token (the ceiling is about 1e6 / that, per core), the SSE events
per token (below 1 where steps that queued up while the server lagged went out merged), and
the engine process's CPU time. Any machine: no GPU runs. ``--tokenizer`` defaults to the
embedded SmolLM2's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from inference.outputs import CompletionOutput, RequestOutput

TEXT = (
    "Kubernetes schedules pods onto nodes; an LLMDeployment names a model, its GPUs and how "
    "many engines serve it. Résumé: naïve café owners write 日本語 and emoji too. "
) * 20


class SyntheticEngine:
    """A real ``LLMEngine`` for everything the core asks of it but the tokens: ``step``
    gives each running completion its next token of ``TEXT`` (no model runs)."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self._ids = engine.tokenizer(TEXT).input_ids
        self._requests: dict[str, list] = {}  # id -> [prompt ids, params, produced, done]
        self._finished: list[RequestOutput] = []
        self.computed_tokens_total = 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def add_request(self, request_id, prompt, params, arrival_time=None, lora_request=None):
        ids = self._engine.tokenizer(prompt).input_ids if isinstance(prompt, str) else prompt
        n = params.n
        self._requests[request_id] = [list(ids), params, [0] * n, [False] * n]

    def abort_request(self, request_id) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            request = self._requests.pop(rid, None)
            if request is not None:
                outputs = [CompletionOutput(i, "", [], None, None, "abort")
                           for i, done in enumerate(request[3]) if not done]  # fmt: skip
                self._finished.append(RequestOutput(rid, None, request[0], outputs, True))

    def stop_sequences(self, stops) -> None:
        for rid, index, _ in stops:
            if rid in self._requests:
                self._requests[rid][3][index] = True

    def leave_text_to_server(self) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._finished)

    def step(self) -> list[RequestOutput]:
        outputs, self._finished = self._finished, []
        ids = self._ids
        for rid, request in list(self._requests.items()):
            prompt, params, produced, done = request
            completions = []
            for i in range(len(produced)):
                if done[i]:
                    continue
                token = ids[(len(prompt) + produced[i] + 7 * i) % len(ids)]
                produced[i] += 1
                finish = "length" if produced[i] >= params.max_tokens else None
                done[i] = finish is not None
                completions.append(CompletionOutput(i, "", [token], None, None, finish))
            self.computed_tokens_total += len(completions)
            finished = all(done)
            if finished:
                del self._requests[rid]
            outputs.append(RequestOutput(rid, None, prompt, completions, finished))
        time.sleep(0.002)  # a short step, so commands get in between
        return outputs

    def stats(self):
        stats = self._engine.stats()
        stats.num_running = len(self._requests)
        stats.num_waiting = 0
        return stats


def synthetic_engine_factory(config):
    from inference.engine_core import default_engine_factory

    return SyntheticEngine(default_engine_factory(config))


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    import asyncio

    import uvicorn

    from inference.async_engine import AsyncLLMEngine
    from inference.bench.common import record, write_json
    from inference.config import EngineConfig
    from inference.server.app import build_app
    from inference.server.metrics import ServerMetrics

    parser = argparse.ArgumentParser(prog="python -m benchmarks.api_check")
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-clients", type=int, default=3)
    parser.add_argument("--tokenizer", default=None, help="default: the embedded SmolLM2's")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    if args.tokenizer is None:
        from inference.model_files import ensure_default_model

        args.tokenizer = str(ensure_default_model())
    # The engine's model: the tokenizer's, with a tiny random body (it never runs but at
    # warm-up; its vocabulary is the tokenizer's).
    folder = _tiny_model_with(args.tokenizer)
    config = EngineConfig.from_kwargs(folder, device="cpu", max_num_seqs=1024,
                                      max_model_len=args.input_len + args.output_len + 64,
                                      num_kv_blocks=64, served_model_name="synthetic")  # fmt: skip
    metrics = ServerMetrics("synthetic")
    engine = AsyncLLMEngine(config, observer=metrics, engine_factory=synthetic_engine_factory)
    app = build_app(engine, metrics, ["synthetic"])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])),
                              daemon=True)  # fmt: skip
    thread.start()
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    events = {"count": 0}
    _count_sse_events(events)
    out = Path(tempfile.mkdtemp()) / "serve.json"
    bench = [sys.executable, "-m", "inference.bench.serve", "--base-url", f"http://127.0.0.1:{port}",
             "--request-rate", "inf", "--input-len", str(args.input_len), "--output-len",
             str(args.output_len), "--token-ids", "--vocab-size", "20000", "--num-clients",
             str(args.num_clients), "--output-json", str(out)]  # fmt: skip
    subprocess.run([*bench, "--num-prompts", "16"], check=True, capture_output=True)
    engine_pid = engine.engine_pid
    api_before, engine_before, events["count"] = _cpu_s(os.getpid()), _cpu_s(engine_pid), 0
    subprocess.run([*bench, "--num-prompts", str(args.num_prompts)], check=True,
                   capture_output=True)  # fmt: skip
    api_s, engine_s = _cpu_s(os.getpid()) - api_before, _cpu_s(engine_pid) - engine_before
    served = json.loads(out.read_text())
    tokens = served["total_output_tokens"]
    result = record(
        "api_check", num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, num_clients=args.num_clients,
        completed=served["completed"], output_tok_s=served["output_tok_s"],
        ttft_p99_ms=served["ttft_p99_ms"], api_cpu_s=round(api_s, 2),
        api_us_per_token=round(api_s / tokens * 1e6, 1),
        sse_events_per_token=round(events["count"] / tokens, 3),
        engine_cpu_s=round(engine_s, 2),
    )  # fmt: skip
    result["command"] = "python -m benchmarks.api_check " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    write_json(args.output_json, result)
    print(json.dumps(result, indent=1))
    server.should_exit = True
    thread.join(30)
    asyncio.run(engine.shutdown(5))
    return 0 if served["completed"] == args.num_prompts else 1


def _count_sse_events(events: dict) -> None:
    """Count the streamed chunks the server renders (``ChunkEnvelope.render``)."""
    from inference.server.completions import ChunkEnvelope

    real = ChunkEnvelope.render

    def counted(self, *a, **k):
        events["count"] += 1
        return real(self, *a, **k)

    ChunkEnvelope.render = counted


def _tiny_model_with(tokenizer_path: str) -> str:
    """A random 2-layer llama sized to the tokenizer, beside a copy of its files."""
    import shutil

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = Path(tempfile.mkdtemp(prefix="api-check-"))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    tokenizer.save_pretrained(folder)
    for name in ("generation_config.json",):
        if (Path(tokenizer_path) / name).exists():
            shutil.copy(Path(tokenizer_path) / name, folder / name)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


if __name__ == "__main__":
    raise SystemExit(main())
