"""``pagoda serve MODEL``: the server's flags (vLLM's names; the engine's come from
``EngineConfig``) and the uvicorn process around the app.

Start-up binds the listening socket first: a port in use fails at once, before minutes of
model loading. The model then loads in the background while /health already answers.

Shutdown (SIGTERM, or Ctrl-C): the server keeps its socket open and keeps accepting
connections while it drains: /ready turns 503 (the pod leaves its Service) and new requests
get 503 with Retry-After, while in-flight ones run on for up to ``--shutdown-grace-seconds``.
What is still running then is aborted: a non-streamed request gets an OpenAI-shaped 503, a
stream an error event and ``[DONE]``. Only then does uvicorn close the socket and run the
app's lifespan shutdown, which stops the engine process, and the process exits 0 (uvicorn
re-raises the signal it caught once it is done, so we keep a no-op handler installed
underneath it instead of the default one that would kill us with status 143). A second
signal during the drain aborts everything at once.

A failed engine (it died, reported a fatal error, or missed ``--engine-step-timeout``)
cannot be recovered in place: the server then exits 1 within about a second, so that
Kubernetes restarts the pod, as vLLM does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from inference.async_engine import DEFAULT_STEP_TIMEOUT_S
from inference.config import EngineConfig, add_engine_args, engine_kwargs
from inference.server.app import DEFAULT_MAX_BODY_BYTES
from inference.server.serving import RequestLimits
from inference.server.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("inference.server")


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
        "--engine-step-timeout",
        type=float,
        default=DEFAULT_STEP_TIMEOUT_S,
        help="seconds without a step (or idle heartbeat) after which the engine counts as "
        "hung: requests fail, /health turns 503 and the server exits 1",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413",
    )
    parser.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=RequestLimits.max_sequences_per_request,
        help="most prompts x n one request may ask for; more gets 400",
    )
    parser.add_argument(
        "--allowed-origins", type=_json_list, default=["*"], help='CORS origins (JSON list)'
    )
    parser.add_argument(
        "--allowed-methods", type=_json_list, default=["*"], help="CORS methods (JSON list)"
    )
    parser.add_argument(
        "--allowed-headers", type=_json_list, default=["*"], help="CORS headers (JSON list)"
    )
    parser.add_argument("--allow-credentials", action="store_true", help="CORS credentials")
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='parse tool calls out of the output when tool_choice is "auto" (needs '
        "--tool-call-parser)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="the model's tool-call format: hermes (Hermes, Qwen) or llama3_json (Llama 3)",
    )
    parser.add_argument(
        "--uvicorn-log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    # The engine's own flags, generated from EngineConfig (the model is the positional
    # argument above, and --served-model-name takes several names here).
    return add_engine_args(parser, exclude=("served_model_name",))


def _json_list(text: str) -> list[str]:
    """vLLM's form, a JSON list ('["https://a.example"]'); a bare word is a list of one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return [text]
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


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
    given = engine_kwargs(args) | {"tokenizer": tokenizer, "load_format": load_format}
    return EngineConfig.from_kwargs(model, served_model_name=names[0], **given)


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
    """Announce readiness with a usable example; stop the server (exit 1) once the engine
    has failed, whether loading or later."""
    announced = False
    while not server.should_exit:
        if engine.failure is not None:
            logger.error("the engine failed (%s); exiting", engine.failure)
            server.should_exit = True
            return
        if engine.loaded and not announced:
            print(f"pagoda is ready. Try:\n  {example}", flush=True)
            announced = True
        time.sleep(0.2)


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a port in use fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def run_serve(args: argparse.Namespace) -> int:
    from inference.async_engine import AsyncLLMEngine
    from inference.server.metrics import ServerMetrics

    # A no-op when `pagoda`'s main has configured logging already.
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for flag, value, minimum in (
        ("--max-queue-len", args.max_queue_len, 1),
        ("--max-request-body-bytes", args.max_request_body_bytes, 1),
        ("--max-sequences-per-request", args.max_sequences_per_request, 1),
    ):
        if value is not None and value < minimum:
            print(f"error: {flag} must be >= {minimum}", file=sys.stderr)
            return 2
    if not args.engine_step_timeout > 0:
        print("error: --engine-step-timeout must be > 0", file=sys.stderr)
        return 2
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        print("error: --enable-auto-tool-choice needs --tool-call-parser", file=sys.stderr)
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
    try:
        sock = _bind(args.host, args.port)
    except OSError as exc:
        print(
            f"error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}"
            " (is another server running there? pick another --port)",
            file=sys.stderr,
        )
        return 1
    metrics = ServerMetrics(names[0])
    engine = AsyncLLMEngine(
        config,
        max_queue_len=args.max_queue_len,
        observer=metrics,
        engine_step_timeout_s=args.engine_step_timeout,
    )
    # The engine process starts loading the model now, while this process imports and
    # builds the app and the HTTP server.
    engine.launch()
    import uvicorn

    from inference.server.app import CorsSettings, build_app

    app = build_app(
        engine,
        metrics,
        names,
        api_key=args.api_key,
        shutdown_grace_s=args.shutdown_grace_seconds,
        limits=RequestLimits(max_sequences_per_request=args.max_sequences_per_request),
        max_body_bytes=args.max_request_body_bytes,
        cors=CorsSettings(
            allowed_origins=args.allowed_origins,
            allowed_methods=args.allowed_methods,
            allowed_headers=args.allowed_headers,
            allow_credentials=args.allow_credentials,
        ),
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
    )
    uv_config = uvicorn.Config(
        app,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        # The drain has waited for the requests already; this bounds slow clients only.
        timeout_graceful_shutdown=5,
        timeout_keep_alive=30,
    )
    server = _make_server(uv_config, engine, args.shutdown_grace_seconds)
    example = _curl_example(args.host, args.port, names[0], args.api_key)
    threading.Thread(
        target=_watch_engine, args=(engine, server, example), name="ready-watch", daemon=True
    ).start()
    _ignore_reraised_signals()
    server.run(sockets=[sock])
    if engine.failure is not None:
        return 1
    return 0


def _ignore_reraised_signals() -> None:
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)


def _make_server(config, engine, grace_s: float):
    """A uvicorn.Server that drains before it stops: on the first signal it keeps serving
    (new requests get 503) until the in-flight ones are done or the grace period is over,
    then exits; a second signal aborts what is left and exits at once."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None
        draining = False

        async def startup(self, sockets=None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)

        def handle_exit(self, sig, frame) -> None:
            loop = self.loop
            if self.draining or loop is None or not engine.loaded:
                if self.draining and loop is not None:  # abort what is left, now
                    loop.call_soon_threadsafe(asyncio.ensure_future, engine.drain(0))
                super().handle_exit(sig, frame)
                return
            self.draining = True
            engine.begin_drain()
            logger.info("draining: finishing in-flight requests for up to %g s", grace_s)
            loop.call_soon_threadsafe(asyncio.ensure_future, self._drain())

        async def _drain(self) -> None:
            await engine.drain(grace_s)
            self.should_exit = True

    return DrainingServer(config)


def main(argv: list[str] | None = None) -> int:
    parser = add_serve_args(argparse.ArgumentParser(prog="pagoda serve"))
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
