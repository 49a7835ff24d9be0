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

``--api-server-count N`` (vLLM's flag): N API processes accept on the one listening socket
and share the engine process, so that parsing requests, rendering templates and writing
streams spread over N cores. This process is the first: it launches the engine and the
others, forwards its shutdown signal to them, waits for them to drain before it stops the
engine, runs the admin API, and exits 1 should one of them die (the pod restarts, as it
would for the engine). Any of them answers ``/metrics`` for the whole engine.
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
from inference.chat_templates import CONTENT_FORMATS, load_chat_template
from inference.config import EngineConfig, add_engine_args, engine_kwargs
from inference.server.app import DEFAULT_MAX_BODY_BYTES
from inference.server.lora_modules import (
    RUNTIME_UPDATES_ENV,
    LoRAModulesAction,
    ServedAdapters,
    parse_lora_modules,
)
from inference.server.reasoning_parsers import REASONING_PARSERS
from inference.server.serving import RequestLimits, ServingOptions
from inference.server.tool_parsers import TOOL_PARSERS
from inference.server.vllm_flags import (
    IGNORED_DEST,
    REFUSED_DEST,
    add_foreign_flags,
    normalize_flag_spelling,
)

ADMIN_KEY_ENV = "PAGODA_ADMIN_API_KEY"
logger = logging.getLogger("inference.server")


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model folder, or 'default' (the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--model", dest="model_flag", default=None, help="the model, instead of the positional"
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default: all)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM)")
    parser.add_argument("--ssl-certfile", default=None, help="TLS certificate chain (PEM)")
    parser.add_argument(
        "--ssl-ca-certs", default=None, help="CA bundle to verify client certificates with"
    )
    parser.add_argument(
        "--root-path", default="", help="path prefix a proxy strips before requests arrive"
    )
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
        "--admin-port", type=int, default=None,
        help="serve the admin API (live engine settings, for the operator's tuner) on this "
             "port, behind --admin-api-key; no Service should route to it (default: off)",
    )  # fmt: skip
    parser.add_argument(
        "--admin-api-key",
        default=os.environ.get(ADMIN_KEY_ENV),
        help=f"the admin API's own key, never the clients' --api-key (default: ${ADMIN_KEY_ENV})",
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
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="return a thinking model's <think> text as reasoning_content, apart from content",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        help="a chat template file, or the template itself (default: the model's; for the "
        "embedded model, a tool-capable version of its own)",
    )
    parser.add_argument(
        "--chat-template-content-format",
        choices=CONTENT_FORMATS,
        default="auto",
        help="message content as a string, or as OpenAI's list of parts (auto: what the "
        "template reads)",
    )
    parser.add_argument(
        "--response-role", default="assistant", help="the role name of chat replies"
    )
    parser.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="logprob tokens as 'token_id:N' (for tokens that are not valid text alone)",
    )
    parser.add_argument(
        "--enable-log-requests",
        dest="log_requests",
        action="store_true",
        default=False,
        help="log each request's prompt (cut to --max-log-len) and sampling parameters",
    )
    parser.add_argument(
        "--disable-log-requests",
        dest="log_requests",
        action="store_false",
        help="do not log requests (the default)",
    )
    parser.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="most prompt characters and token ids a request log line shows",
    )
    parser.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="accepted for vLLM compatibility: pagoda logs no periodic stats (see /metrics)",
    )
    parser.add_argument(
        "--uvicorn-log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    parser.add_argument(
        "--api-server-count", type=int, default=1, metavar="N",
        help="API processes sharing the port and the engine (default 1): more spread request "
        "parsing and streaming over more cores, for many concurrent clients",
    )
    parser.add_argument(
        "--lora-modules", nargs="+", type=parse_lora_modules, action=LoRAModulesAction,
        default=[], metavar="MODULE",
        help="LoRA adapters served under model names (with --enable-lora): name=path, or "
        '\'{"name": "sql", "path": "/adapters/sql", "base_model_name": "..."}\', or a JSON '
        "list of those ('[]': none); more at run time through /v1/load_lora_adapter when "
        f"{RUNTIME_UPDATES_ENV}=True, or through the admin API",
    )
    add_foreign_flags(parser)
    # The engine's own flags, generated from EngineConfig (the model is the positional
    # argument above, and --served-model-name takes several names here).
    return add_engine_args(parser, exclude=("served_model_name",))


def resolve_model_arg(args: argparse.Namespace) -> None:
    """``args.model`` from the positional or ``--model`` (vLLM takes either); ValueError
    if both name different models."""
    flag = getattr(args, "model_flag", None)
    if flag is not None and args.model is not None and flag != args.model:
        raise ValueError(f"two models given: {args.model!r} and --model {flag!r}")
    args.model = flag or args.model or "default"


def check_serve_args(args: argparse.Namespace) -> list[str]:
    """What is wrong with the server's own flags, one message each (empty: all good)."""
    errors = [f"{line} (refused)" for line in getattr(args, REFUSED_DEST, [])]
    for flag, value, minimum in (
        ("--max-queue-len", args.max_queue_len, 1),
        ("--max-request-body-bytes", args.max_request_body_bytes, 1),
        ("--max-sequences-per-request", args.max_sequences_per_request, 1),
        ("--max-log-len", args.max_log_len, 0),
    ):
        if value is not None and value < minimum:
            errors.append(f"{flag} must be >= {minimum}")
    if not args.engine_step_timeout > 0:
        errors.append("--engine-step-timeout must be > 0")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        errors.append("--enable-auto-tool-choice needs --tool-call-parser")
    if args.admin_port is not None:
        errors.extend(_admin_errors(args))
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        errors.append("--ssl-keyfile and --ssl-certfile go together")
    if args.lora_modules and not args.enable_lora:
        errors.append("--lora-modules needs --enable-lora")
    if args.api_server_count < 1:
        errors.append("--api-server-count must be >= 1")
    elif args.api_server_count > 1 and args.enable_lora:
        errors.append("--api-server-count > 1 does not serve LoRA adapters yet (each API "
                      "process would keep adapters of its own): drop --enable-lora or use 1")
    return errors


def served_adapters(args: argparse.Namespace, config: EngineConfig,
                    names: list[str]) -> ServedAdapters:
    """The --lora-modules, each checked against the model (ValueError says which and why)."""
    from inference.model_files import resolve_model
    from inference.models.config import ModelConfig

    model_config = ModelConfig.from_folder(resolve_model(config.model)) if (
        config.enable_lora) else None  # fmt: skip
    adapters = ServedAdapters(names, model_config, config.max_lora_rank, config.enable_lora)
    for module in args.lora_modules:
        try:
            adapters.add(module.name, module.path, module.base_model_name)
        except ValueError as exc:
            raise ValueError(f"--lora-modules {module.name}: {exc}") from None
    return adapters


def _admin_errors(args: argparse.Namespace) -> list[str]:
    if not args.admin_api_key:
        return [f"--admin-port needs --admin-api-key (or ${ADMIN_KEY_ENV})"]
    if args.admin_api_key == args.api_key:
        return ["--admin-api-key must differ from --api-key: every client holds that one"]
    if args.admin_port == args.port:
        return ["--admin-port must differ from --port"]
    return []


def serving_options(args: argparse.Namespace) -> ServingOptions:
    """How requests are rendered and logged; ValueError for a --chat-template that is
    neither a file nor a template."""
    return ServingOptions(
        response_role=args.response_role,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        log_requests=args.log_requests,
        max_log_len=args.max_log_len,
        chat_template=load_chat_template(args.chat_template),
        chat_template_content_format=args.chat_template_content_format,
        reasoning_parser=args.reasoning_parser,
    )


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
    resolve_model_arg(args)
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
    from inference.model_shapes import resolve_shape_model, shape_config

    load_format = args.load_format or "auto"
    if shape_config(args.model) is None:
        return args.model, args.tokenizer, load_format
    folder, extra = resolve_shape_model(args.model, with_tokenizer=args.tokenizer is None)
    tokenizer = args.tokenizer or str(Path(folder) / "tokenizer")
    return folder, tokenizer, args.load_format or extra.get("load_format", "dummy")


def engine_config(args: argparse.Namespace, names: list[str]) -> EngineConfig:
    resolve_model_arg(args)
    model, tokenizer, load_format = _model_source(args)
    given = engine_kwargs(args) | {"tokenizer": tokenizer, "load_format": load_format}
    return EngineConfig.from_kwargs(model, served_model_name=names[0], **given)


def _curl_example(scheme: str, host: str, port: int, model: str, api_key: str | None) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    auth = " -H 'Authorization: Bearer $PAGODA_API_KEY'" if api_key else ""
    body = (
        f'{{"model": "{model}", "messages": [{{"role": "user", "content": '
        '"Write a haiku about Kubernetes."}], "max_tokens": 64}'
    )
    return (
        f"curl -s {scheme}://{shown}:{port}/v1/chat/completions{auth} "
        f"-H 'Content-Type: application/json' -d '{body}'"
    )


def _watch_engine(engine, server, example: str | None, fronts: _Fronts | None = None) -> None:
    """Announce readiness with a usable example; stop the server (exit 1) once the engine
    has failed, whether loading or later, or another API process died."""
    announced = example is None
    while not server.should_exit:
        if engine.failure is not None:
            logger.error("the engine failed (%s); exiting", engine.failure)
            server.should_exit = True
            return
        dead = fronts.dead() if fronts is not None and not server.draining else []
        if dead:
            logger.error("API process %s exited unexpectedly (exit code %s); exiting",
                         dead[0].pid, dead[0].exitcode)  # fmt: skip
            fronts.failed = True
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
    # A no-op when `pagoda`'s main has configured logging already.
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    errors = check_serve_args(args)
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    if errors:
        return 2
    for line in getattr(args, IGNORED_DEST, []):
        logger.info("%s (no effect)", line)
    # The engine runs in its own process, but the thread that reads its step messages shares
    # the GIL with the event loop: when it wakes up while the loop is busy writing streams,
    # it waits up to one switch interval, and CPython's default of 5 ms exceeds a decode step.
    sys.setswitchinterval(0.001)
    try:
        resolve_model_arg(args)
        names = served_names(args)
        config = engine_config(args, names)
        options = serving_options(args)
        adapters = served_adapters(args, config, names)
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
    admin_sock = None
    if args.admin_port is not None:
        try:
            admin_sock = _bind(args.host, args.admin_port)
        except OSError as exc:
            print(f"error: cannot listen on {args.host}:{args.admin_port} (--admin-port): "
                  f"{exc.strerror or exc}", file=sys.stderr)  # fmt: skip
            return 1
    engine, metrics = _engine_front(args, config, names)
    # The engine process starts loading the model now, while this process imports and
    # builds the app and the HTTP server (and the other API processes start).
    front_ends = engine.launch(args.api_server_count)
    fronts = _start_fronts(args, sock, front_ends, engine.engine_pid)
    admin = _admin_server(args, engine, admin_sock, adapters) if admin_sock is not None else None
    server = _make_server(_uvicorn_config(args, engine, metrics, names, options, adapters),
                          engine, args.shutdown_grace_seconds, admin, fronts)  # fmt: skip
    scheme = "https" if args.ssl_certfile else "http"
    example = _curl_example(scheme, args.host, args.port, names[0], args.api_key)
    threading.Thread(
        target=_watch_engine, args=(engine, server, example, fronts), name="ready-watch",
        daemon=True,
    ).start()
    _ignore_reraised_signals()
    server.run(sockets=[sock])
    code = 1 if engine.failure is not None or fronts.failed else 0
    fronts.stop()
    return code


def _engine_front(args: argparse.Namespace, config: EngineConfig, names: list[str]):
    """This API process's engine front and the metrics it reports to (the engine process
    is launched or attached to after)."""
    from inference.async_engine import AsyncLLMEngine
    from inference.server.metrics import ServerMetrics

    metrics = ServerMetrics(names[0])
    engine = AsyncLLMEngine(
        config,
        max_queue_len=args.max_queue_len,
        observer=metrics,
        engine_step_timeout_s=args.engine_step_timeout,
    )
    return engine, metrics


def _uvicorn_config(args: argparse.Namespace, engine, metrics, names: list[str],
                    options: ServingOptions, adapters: ServedAdapters):  # fmt: skip
    """The app of one API process, under uvicorn's settings."""
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
        options=options,
        root_path=args.root_path,
        adapters=adapters,
    )
    return uvicorn.Config(
        app,
        log_level=args.uvicorn_log_level,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        access_log=not args.disable_uvicorn_access_log,
        # The drain has waited for the requests already; this bounds slow clients only.
        timeout_graceful_shutdown=5,
        timeout_keep_alive=30,
    )


class _Fronts:
    """The other API processes (``--api-server-count``), as the first one sees them."""

    def __init__(self, processes: list) -> None:
        self.processes = processes
        self.failed = False  # one exited while it should have been serving

    def signal(self, sig: int) -> None:
        for process in self.processes:
            if process.is_alive():
                try:
                    os.kill(process.pid, sig)
                except ProcessLookupError:
                    pass

    def dead(self) -> list:
        return [p for p in self.processes if p.exitcode is not None]

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for all of them to exit; True if they have."""
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        return not any(process.is_alive() for process in self.processes)

    def stop(self) -> None:
        """After this process's server stopped: whoever is still running is stopped too."""
        if self.wait(5.0):
            return
        self.signal(signal.SIGTERM)
        if not self.wait(10.0):
            self.signal(signal.SIGKILL)
            self.wait(5.0)


def _start_fronts(args: argparse.Namespace, sock: socket.socket, front_ends: list,
                  engine_pid: int) -> _Fronts:  # fmt: skip
    """The other API processes, each on the shared socket with its pipes to the engine."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    processes = []
    for index, (commands, outputs) in enumerate(front_ends, start=1):
        process = context.Process(
            target=_serve_front, args=(args, sock, commands, outputs, engine_pid, index),
            name=f"pagoda-api-{index}",
        )  # fmt: skip
        process.start()
        commands.close()  # only that process holds its pipe ends now
        outputs.close()
        processes.append(process)
    return _Fronts(processes)


def _serve_front(args: argparse.Namespace, sock: socket.socket, commands, outputs,
                 engine_pid: int, index: int) -> None:  # fmt: skip
    """Another API process's entry point (``--api-server-count``): the same app, attached to
    the first process's engine; it drains on SIGTERM (which the first forwards) and
    leaves Ctrl-C to the first."""
    from inference.engine_core import exit_with_parent

    logging.basicConfig(
        level=getattr(args, "log_level", "INFO").upper(),
        format=f"%(asctime)s %(levelname)s %(name)s[api {index}]: %(message)s",
    )
    exit_with_parent()
    sys.setswitchinterval(0.001)
    names = served_names(args)
    config = engine_config(args, names)
    engine, metrics = _engine_front(args, config, names)
    engine.attach(commands, outputs, engine_pid)
    uv_config = _uvicorn_config(args, engine, metrics, names, serving_options(args),
                                served_adapters(args, config, names))  # fmt: skip
    server = _make_server(uv_config, engine, args.shutdown_grace_seconds, ignore_sigint=True)
    threading.Thread(
        target=_watch_engine, args=(engine, server, None), name="engine-watch", daemon=True
    ).start()
    _ignore_reraised_signals()
    server.run(sockets=[sock])
    sys.exit(1 if engine.failure is not None else 0)


def _ignore_reraised_signals() -> None:
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)


def _admin_server(args: argparse.Namespace, engine, sock: socket.socket,
                  adapters: ServedAdapters):  # fmt: skip
    """The admin API's server on its bound socket (``inference.server.admin``), as the
    (server, socket) ``_make_server`` runs in the serving server's event loop, which owns
    the signals."""
    import contextlib

    import uvicorn

    from inference.server.admin import build_admin_app

    class AdminServer(uvicorn.Server):
        def capture_signals(self):
            return contextlib.nullcontext()  # the serving server drains, then stops this one

    config = uvicorn.Config(
        build_admin_app(engine, args.admin_api_key, adapters), lifespan="off",
        log_level=args.uvicorn_log_level, ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
        access_log=not args.disable_uvicorn_access_log,
    )  # fmt: skip
    return AdminServer(config), sock


def _make_server(config, engine, grace_s: float, admin=None, fronts: _Fronts | None = None,
                 *, ignore_sigint: bool = False):  # fmt: skip
    """A uvicorn.Server that drains before it stops: on the first signal it keeps serving
    (new requests get 503) until the in-flight ones are done or the grace period is over,
    then exits; a second signal aborts what is left and exits at once. ``admin``: the admin
    API's (server, socket), started and stopped with this one. ``fronts``: the other API
    processes, which get each signal too and which the drain waits for (the engine stops
    after them). ``ignore_sigint``: another API process's, which Ctrl-C reaches with the
    whole process group, but which stops on the first process's word (SIGTERM)."""
    import uvicorn

    front_wait_s = grace_s + 15.0  # their drain, their abort flush, their exit

    class DrainingServer(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None
        draining = False
        admin_task: asyncio.Task | None = None

        async def startup(self, sockets=None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)
            if admin is not None:
                admin_server, admin_sock = admin
                self.admin_task = asyncio.create_task(admin_server.serve(sockets=[admin_sock]))

        async def shutdown(self, sockets=None) -> None:
            if self.admin_task is not None:
                admin[0].should_exit = True
                await self.admin_task
            await super().shutdown(sockets=sockets)

        def handle_exit(self, sig, frame) -> None:
            if ignore_sigint and sig == signal.SIGINT:
                return
            if fronts is not None:
                fronts.signal(signal.SIGTERM)
            loop = self.loop
            if self.draining or loop is None or not engine.loaded:
                if self.draining and loop is not None:  # abort what is left, now
                    logger.info("second signal: stopping now")
                    loop.call_soon_threadsafe(asyncio.ensure_future, engine.drain(0, now=True))
                super().handle_exit(sig, frame)
                return
            self.draining = True
            engine.begin_drain()
            logger.info("draining: finishing in-flight requests for up to %g s", grace_s)
            loop.call_soon_threadsafe(asyncio.ensure_future, self._drain())

        async def _drain(self) -> None:
            await engine.drain(grace_s)
            if fronts is not None and not await asyncio.to_thread(fronts.wait, front_wait_s):
                logger.warning("API processes still running after %g s", front_wait_s)
            self.should_exit = True

    return DrainingServer(config)


def main(argv: list[str] | None = None) -> int:
    parser = add_serve_args(argparse.ArgumentParser(prog="pagoda serve"))
    return run_serve(parser.parse_args(normalize_flag_spelling(sys.argv[1:] if argv is None
                                                               else argv)))


if __name__ == "__main__":
    sys.exit(main())
