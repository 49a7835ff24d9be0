"""The FastAPI application: OpenAI routes, tokenizer routes, probes and metrics.

``build_app`` wires an AsyncLLMEngine into routes; the lifespan starts the engine process
(the model loads in the background so /health answers at once and /ready tells the truth)
and, on shutdown, drains in-flight requests for the grace period before stopping it.

Around the routes, plain ASGI middleware: a cap on the request body (413 before a byte more
than the cap is read, so a huge body can neither exhaust memory nor keep the tokenizer busy
for minutes), the request id (the client's ``X-Request-Id`` or a fresh one, echoed on every
response and used in the response's ``id``), and CORS as vLLM configures it. There is no
``/docs`` page: FastAPI's would load its scripts from a CDN; ``/openapi.json`` stays.
"""

from __future__ import annotations

import re
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inference.async_engine import AsyncLLMEngine
from inference.server.chat import ChatServing
from inference.server.completions import CompletionServing
from inference.server.errors import APIError, error_body, install_error_handlers
from inference.server.lora_modules import ServedAdapters, runtime_updates_allowed
from inference.server.metrics import ServerMetrics
from inference.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UnloadLoRAAdapterRequest,
)
from inference.server.serving import RequestLimits, ServingOptions, TokenizerPool

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,256}$")  # printable ASCII, no spaces


@dataclass(frozen=True)
class CorsSettings:
    """vLLM's --allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials."""

    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


def server_version() -> str:
    try:
        return version("pagoda")
    except PackageNotFoundError:
        return "unknown"


class BodySizeLimit:
    """413 for a body over ``max_bytes``: at once from its Content-Length, or as soon as a
    chunked body grows past it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> str:
        return (
            f"the request body is larger than this server accepts ({self.max_bytes} bytes, "
            "--max-request-body-bytes)"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            response = JSONResponse(error_body(413, self._too_large()), status_code=413)
            await response(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI turns this into the app's OpenAI-shaped 413.
                    raise StarletteHTTPException(413, self._too_large())
            return message

        await self.app(scope, limited_receive, send)


class RequestIdMiddleware:
    """The client's X-Request-Id (or a fresh one) in ``request.state.request_id`` and on
    the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope["headers"]).get(REQUEST_ID_HEADER.lower().encode())
        request_id = sent.decode("latin-1") if sent is not None else uuid.uuid4().hex
        if not _REQUEST_ID.match(request_id):
            message = f"{REQUEST_ID_HEADER} must be 1 to 256 printable ASCII characters"
            response = JSONResponse(error_body(400, message), status_code=400)
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["request_id"] = request_id
        header = (REQUEST_ID_HEADER.lower().encode(), request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        await self.app(scope, receive, send_with_id)


class RootPath:
    """The ASGI root path (--root-path) of requests a proxy forwards without a prefix it
    has stripped; what the server's own settings give (uvicorn's) is kept."""

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.root_path = root_path.rstrip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and not scope.get("root_path"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)


_bearer = HTTPBearer(auto_error=False, description="The server's --api-key, if one is set.")


def _api_key_check(api_key: str | None):
    async def check(
        credentials: HTTPAuthorizationCredentials | None = Depends(_bearer),  # noqa: B008
    ) -> None:
        if api_key is None:
            return
        token = credentials.credentials if credentials else ""
        if not secrets.compare_digest(token.encode(), api_key.encode()):
            raise APIError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check


def build_app(
    engine: AsyncLLMEngine,
    metrics: ServerMetrics,
    served_model_names: list[str],
    *,
    api_key: str | None = None,
    shutdown_grace_s: float = 30.0,
    limits: RequestLimits | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    cors: CorsSettings | None = None,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    options: ServingOptions | None = None,
    root_path: str = "",
    adapters: ServedAdapters | None = None,
) -> FastAPI:
    """``root_path``: the path prefix a proxy strips before requests reach the server
    (vLLM's --root-path), so that generated URLs (the OpenAPI schema's) carry it."""
    limits = limits or RequestLimits()
    tokenizer_pool = TokenizerPool()
    adapters = adapters or ServedAdapters(served_model_names)
    shared = {"limits": limits, "tokenizer_pool": tokenizer_pool, "options": options,
              "adapters": adapters}  # fmt: skip
    completions = CompletionServing(engine, served_model_names, **shared)
    chat = ChatServing(
        engine, served_model_names, tool_call_parser=tool_call_parser,
        enable_auto_tool_choice=enable_auto_tool_choice, **shared,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await engine.shutdown(shutdown_grace_s)
            tokenizer_pool.shutdown()

    app = FastAPI(
        title="pagoda", version=server_version(), lifespan=lifespan, docs_url=None,
        redoc_url=None,
    )
    install_error_handlers(app)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.adapters = adapters  # the admin API's adapter routes change the same list
    # The last one added runs first: CORS answers preflights before anything else.
    app.add_middleware(RequestIdMiddleware)
    if root_path:
        app.add_middleware(RootPath, root_path=root_path)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    cors = cors or CorsSettings()
    app.add_middleware(
        CORSMiddleware,
        allow_origins=cors.allowed_origins,
        allow_methods=cors.allowed_methods,
        allow_headers=cors.allowed_headers,
        allow_credentials=cors.allow_credentials,
        expose_headers=[REQUEST_ID_HEADER],
    )

    authenticated = [Depends(_api_key_check(api_key))]
    v1 = APIRouter(prefix="/v1", dependencies=authenticated)

    @v1.get("/models")
    async def list_models() -> dict[str, Any]:
        config = engine.config
        created = int(time.time())
        cards = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "pagoda",
                "root": config.model,
                "parent": None,
                "max_model_len": config.max_model_len,
            }
            for name in served_model_names
        ]
        cards += adapters.cards(created, config.max_model_len)
        return {"object": "list", "data": cards}

    if runtime_updates_allowed():
        add_lora_routes(v1, engine, adapters)

    @v1.post("/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await completions.create(body, raw)

    @v1.post("/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(body, raw)

    app.include_router(v1)
    tokenizer_routes = APIRouter(dependencies=authenticated)
    _add_tokenizer_routes(tokenizer_routes, chat)
    app.include_router(tokenizer_routes)
    _add_probes(app, engine, metrics)
    return app


def add_lora_routes(router: APIRouter, engine: AsyncLLMEngine, adapters: ServedAdapters) -> None:
    """vLLM's runtime adapter routes: on the serving port only with
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, on the admin port always (``inference.server.admin``)."""

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        try:
            adapters.add(body.lora_name, body.lora_path)
        except ValueError as exc:
            raise APIError(400, str(exc), param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        try:
            removed = adapters.remove(body.lora_name)
        except KeyError:
            raise APIError(404, f"The LoRA adapter '{body.lora_name}' cannot be found.",
                           param="lora_name", code="model_not_found") from None
        engine.remove_lora(removed.lora_int_id)
        return PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _add_tokenizer_routes(router: APIRouter, chat: ChatServing) -> None:
    """/tokenize and /detokenize: authenticated like /v1, tokenized like completions."""

    def tokenize_body(body: TokenizeCompletionRequest | TokenizeChatRequest) -> list[int]:
        if isinstance(body, TokenizeChatRequest):
            text = chat.render_chat(
                body.messages, body.add_generation_prompt, body.continue_final_message
            )
            return chat.encode(text, add_special_tokens=body.add_special_tokens)
        return chat.encode(body.prompt, add_special_tokens=body.add_special_tokens)

    @router.post("/tokenize")
    async def tokenize(
        body: TokenizeCompletionRequest | TokenizeChatRequest, raw: Request
    ) -> dict[str, Any]:
        chat.check_model(body.model)
        tokens = await chat.tokenizer_pool.run(raw, tokenize_body, body)
        return {"count": len(tokens), "max_model_len": chat.max_model_len, "tokens": tokens}

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, raw: Request) -> dict[str, Any]:
        chat.check_model(body.model)
        chat.check_token_ids(body.tokens, "tokens")
        tokenizer = chat.tokenizer
        return {"prompt": await chat.tokenizer_pool.run(raw, tokenizer.decode, body.tokens)}


def _add_probes(app: FastAPI, engine: AsyncLLMEngine, metrics: ServerMetrics) -> None:
    @app.head("/health", include_in_schema=False)
    @app.get("/health")
    async def health() -> Response:
        """Liveness: the server answers and the engine process is alive and reporting."""
        problem = engine.health_problem
        if problem is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: the model is loaded and warmed up, and the server is not draining."""
        if engine.ready:
            return JSONResponse({"status": "ready"})
        state = "loading" if not engine.loaded else "not accepting requests"
        return JSONResponse({"status": state}, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def server_version_route() -> dict[str, str]:
        return {"version": server_version()}
