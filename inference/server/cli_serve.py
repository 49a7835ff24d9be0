"""``pagoda serve MODEL``: flags (vLLM's names) and the uvicorn process around the app.

Shutdown: on SIGTERM uvicorn closes the listening socket, lets in-flight responses finish
for ``--shutdown-grace-seconds`` (then cancels them, which aborts their engine requests),
and runs the app's lifespan shutdown, which stops the engine process. The process then exits
0: uvicorn re-raises the signal it caught once it is done, so we keep a no-op handler
installed underneath it instead of the default one that would kill us with status 143.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import fields
from pathlib import Path

from inference.config import EngineConfig

logger = logging.getLogger("inference.server")

_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "model",
        nargs="?",
        default="default",
        help="model folder, or 'default' (the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default: all)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in 'model'; the first is reported (default: folder name)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("PAGODA_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $PAGODA_API_KEY)",
    )
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer folder (default: the model's own)"
    )
    parser.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        default=None,
        help="dummy: random weights (implied for the named benchmark shapes)",
    )
    parser.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=_DEFAULTS["tensor_parallel_size"]
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=_DEFAULTS["gpu_memory_utilization"]
    )
    parser.add_argument("--max-num-seqs", type=int, default=_DEFAULTS["max_num_seqs"])
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=_DEFAULTS["block_size"])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--dtype", default=_DEFAULTS["dtype"])
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS["enable_prefix_caching"],
    )
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--seed", type=int, default=_DEFAULTS["seed"])
    parser.add_argument(
        "--num-kv-blocks", type=int, default=None, help="pin the KV-cache size in blocks"
    )
    parser.add_argument(
        "--max-queue-len",
        type=int,
        default=None,
        help="answer 429 while this many requests wait (default: unbounded)",
    )
    parser.add_argument(
        "--shutdown-grace-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM, how long in-flight requests may take to finish",
    )
    parser.add_argument(
        "--uvicorn-log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    return parser


def served_names(args: argparse.Namespace) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    from inference.model_files import _DEFAULT_ALIASES, DEFAULT_MODEL_NAME

    if args.model in _DEFAULT_ALIASES:
        return [DEFAULT_MODEL_NAME]
    return [Path(args.model.rstrip("/")).name or args.model]


def _model_source(args: argparse.Namespace) -> tuple[str, str | None, str]:
    """(model folder, tokenizer, load format). A named benchmark shape (qwen2.5-1.5b, ...)
    serves random weights of that exact shape with a synthetic tokenizer of its exact
    vocabulary (one word per id), unless --tokenizer names a real one."""
    from inference.model_shapes import SHAPES, resolve_shape_model

    load_format = args.load_format or "auto"
    if args.model not in SHAPES:
        return args.model, args.tokenizer, load_format
    folder, extra = resolve_shape_model(args.model, with_tokenizer=args.tokenizer is None)
    tokenizer = args.tokenizer or str(Path(folder) / "tokenizer")
    return folder, tokenizer, args.load_format or extra.get("load_format", "dummy")


def engine_config(args: argparse.Namespace, names: list[str]) -> EngineConfig:
    model, tokenizer, load_format = _model_source(args)
    return EngineConfig.from_kwargs(
        model,
        tokenizer=tokenizer,
        load_format=load_format,
        served_model_name=names[0],
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager,
        dtype=args.dtype,
        seed=args.seed,
        device=args.device,
        num_kv_blocks=args.num_kv_blocks,
    )


def _curl_example(host: str, port: int, model: str, api_key: str | None) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    auth = " -H 'Authorization: Bearer $PAGODA_API_KEY'" if api_key else ""
    body = (
        f'{{"model": "{model}", "messages": [{{"role": "user", "content": '
        '"Write a haiku about Kubernetes."}], "max_tokens": 64}'
    )
    return (
        f"curl -s http://{shown}:{port}/v1/chat/completions{auth} "
        f"-H 'Content-Type: application/json' -d '{body}'"
    )


def _watch_engine(engine, server, example: str) -> None:
    """Announce readiness with a usable example, or stop the server if loading failed."""
    while not server.should_exit:
        if engine.loaded:
            print(f"pagoda is ready. Try:\n  {example}", flush=True)
            return
        if engine.failure is not None:
            logger.error("the engine failed to start; shutting down")
            server.should_exit = True
            return
        time.sleep(0.2)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from inference.async_engine import AsyncLLMEngine
    from inference.server.app import build_app
    from inference.server.metrics import ServerMetrics

    # A no-op when `pagoda`'s main has configured logging already.
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.max_queue_len is not None and args.max_queue_len < 1:
        print("error: --max-queue-len must be >= 1", file=sys.stderr)
        return 2
    # The engine runs in its own process, but the thread that reads its step messages shares
    # the GIL with the event loop: when it wakes up while the loop is busy writing streams,
    # it waits up to one switch interval, and CPython's default of 5 ms exceeds a decode step.
    sys.setswitchinterval(0.001)
    names = served_names(args)
    try:
        config = engine_config(args, names)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    metrics = ServerMetrics(names[0])
    engine = AsyncLLMEngine(config, max_queue_len=args.max_queue_len, observer=metrics)
    app = build_app(
        engine,
        metrics,
        names,
        api_key=args.api_key,
        shutdown_grace_s=args.shutdown_grace_seconds,
    )
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=args.shutdown_grace_seconds,
        timeout_keep_alive=30,
    )
    server = _make_server(uv_config, engine)
    example = _curl_example(args.host, args.port, names[0], args.api_key)
    threading.Thread(
        target=_watch_engine, args=(engine, server, example), name="ready-watch", daemon=True
    ).start()
    _ignore_reraised_signals()
    server.run()
    if engine.failure is not None:
        return 1
    return 0


def _ignore_reraised_signals() -> None:
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)


def _make_server(config, engine):
    """A uvicorn.Server that also marks the engine as draining the moment a signal
    arrives, so /ready turns 503 (and the pod leaves its Service) before connections close."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            engine.begin_drain()
            super().handle_exit(sig, frame)

    return DrainingServer(config)


def main(argv: list[str] | None = None) -> int:
    parser = add_serve_args(argparse.ArgumentParser(prog="pagoda serve"))
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
