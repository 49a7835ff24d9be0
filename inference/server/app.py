"""The FastAPI application: OpenAI routes, tokenizer routes, probes and metrics.

``build_app`` wires an AsyncLLMEngine into routes; the lifespan starts the engine process
(the model loads in the background so /health answers at once and /ready tells the truth)
and, on shutdown, drains in-flight requests for the grace period before stopping it.
"""

from __future__ import annotations

import secrets
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from inference.async_engine import AsyncLLMEngine
from inference.server.chat import ChatServing
from inference.server.completions import CompletionServing
from inference.server.errors import APIError, install_error_handlers
from inference.server.metrics import ServerMetrics
from inference.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

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
) -> FastAPI:
    completions = CompletionServing(engine, served_model_names)
    chat = ChatServing(engine, served_model_names)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await engine.shutdown(shutdown_grace_s)

    app = FastAPI(title="pagoda", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.state.engine = engine
    app.state.metrics = metrics

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_check(api_key))])

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
        return {"object": "list", "data": cards}

    @v1.post("/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await completions.create(body, raw)

    @v1.post("/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(body, raw)

    app.include_router(v1)
    _add_tokenizer_routes(app, chat)
    _add_probes(app, engine, metrics)
    return app


def _add_tokenizer_routes(app: FastAPI, chat: ChatServing) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
        chat.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            text = chat.render_chat(
                body.messages, body.add_generation_prompt, body.continue_final_message
            )
            tokens = chat.encode(text, add_special_tokens=body.add_special_tokens)
        else:
            tokens = chat.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": chat.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        chat.check_model(body.model)
        chat.check_token_ids(body.tokens, "tokens")
        return {"prompt": chat.tokenizer.decode(body.tokens)}


def _add_probes(app: FastAPI, engine: AsyncLLMEngine, metrics: ServerMetrics) -> None:
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
