"""The router's HTTP API: the engine server's OpenAI routes, each proxied to one engine.

A request is read whole (it is small; its ``model`` and prefix decide the engine), then sent
to the engines in the order ``picking`` gives until one starts it: a connection refused, or
an answer of 503 or 429 before any byte of the body, moves on to the next engine (nothing was
generated, so nothing is done twice). Once an engine answers, its status, headers and body go
to the client as they arrive, a stream's events one by one. Errors of the router's own have
the engine server's OpenAI shape (``inference.server.errors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

from inference.router.backends import Backend, BackendPool
from inference.router.picking import affinity_order, least_load_order, prefix_key
from inference.server.errors import error_body

logger = logging.getLogger(__name__)

RETRIED_STATUSES = (429, 503)  # the engine refused before starting: queue full, not ready
# Hop-by-hop headers (RFC 9110 section 7.6.1) and those httpx recomputes.
DROPPED_HEADERS = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length",
}  # fmt: skip
PROXIED_POSTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/tokenize",
                 "/detokenize")  # fmt: skip


@dataclass(frozen=True)
class RouterSettings:
    policy: str = "prefix"  # prefix | least-load | round-robin
    balance: float = 1.25  # bounded-load factor: an engine carries at most 1.25x its share
    prefix_chars: int = 2048
    max_attempts: int = 3
    api_key: str | None = None  # clients must send it; it is also passed on to the engines
    backend_api_key: str | None = None  # sent to the engines instead of the client's header
    max_body_bytes: int = 32 * 1024 * 1024
    scrape_interval_s: float = 2.0
    connect_timeout_s: float = 5.0
    # How long a request for a known model with no engine up is held (an engine starting,
    # from zero replicas or after a crash) before a 503; 0 answers at once.
    cold_start_timeout_s: float = 0.0


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pagoda_router_requests", "Requests by model, engine and outcome",
            ["model", "backend", "outcome"], registry=self.registry,
        )  # fmt: skip
        self.retries = Counter(
            "pagoda_router_retries", "Requests sent on to another engine before they started",
            ["model"], registry=self.registry,
        )  # fmt: skip
        self.unrouted = Counter(
            "pagoda_router_unrouted_requests",
            "Requests no engine could take (the demand an autoscaler from zero reads)",
            ["model", "reason"], registry=self.registry,
        )  # fmt: skip
        self.in_flight = Gauge(
            "pagoda_router_in_flight", "Requests in flight per engine", ["backend"],
            registry=self.registry,
        )  # fmt: skip
        self.held = Gauge(
            "pagoda_router_held_requests",
            "Requests held until an engine of their model is up: demand for a model at zero "
            "replicas (the operator's KEDA trigger wakes it on this)",
            ["model"], registry=self.registry,
        )  # fmt: skip


def error(status: int, message: str, **kwargs: Any) -> JSONResponse:
    headers = kwargs.pop("headers", None)
    return JSONResponse(error_body(status, message, **kwargs), status, headers=headers)


class RelayResponse(StreamingResponse):
    """An engine's answer relayed chunk by chunk. Whatever ends it (the last chunk, a broken
    engine stream, a client that went away, even before the first chunk), the engine's
    response is closed, which aborts the request there, and ``done`` is told once."""

    def __init__(self, upstream: httpx.Response, done: Callable[[str], None]) -> None:
        self.upstream = upstream
        self.outcome = "ok" if upstream.status_code < 400 else str(upstream.status_code)
        self._done = done
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in DROPPED_HEADERS}
        super().__init__(self._chunks(), status_code=upstream.status_code, headers=headers)

    async def _chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError:
            self.outcome = "broken_stream"
            raise

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except BaseException:
            if self.outcome == "ok":
                self.outcome = "client_gone"
            raise
        finally:
            await self.upstream.aclose()
            self._done(self.outcome)


class Router:
    """Picks the engines for a request and carries it to the first that takes it."""

    def __init__(self, pool: BackendPool, settings: RouterSettings) -> None:
        self.pool = pool
        self.settings = settings
        self.metrics = RouterMetrics()
        self._turn = 0  # round-robin's position
        self.client: httpx.AsyncClient | None = None

    def order(self, candidates: list[Backend], body: dict[str, Any]) -> list[Backend]:
        by_url = {b.url: b for b in candidates}
        policy = self.settings.policy
        key = prefix_key(body, self.settings.prefix_chars) if policy == "prefix" else None
        if policy == "round-robin":
            urls = sorted(by_url)
            self._turn += 1
            ordered = urls[self._turn % len(urls):] + urls[: self._turn % len(urls)]
        elif key is not None:
            in_flight = {b.url: b.requests() for b in candidates}
            ring = self.pool.ring(candidates)
            ordered = affinity_order(key, ring, in_flight, self.settings.balance)
        else:
            ordered = least_load_order({b.url: b.load() for b in candidates})
        return [by_url[url] for url in ordered][: max(self.settings.max_attempts, 1)]

    def outgoing_headers(self, request: Request) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED_HEADERS}
        if self.settings.backend_api_key is not None:
            headers["authorization"] = f"Bearer {self.settings.backend_api_key}"
        return headers

    async def forward(self, request: Request, raw: bytes, body: dict[str, Any]) -> Response:
        """The first engine's answer; while no engine of a known model is up (none listens,
        or each answers 503 while it loads), the request is held (up to
        ``cold_start_timeout_s``) and tried again as engines come up."""
        model = body.get("model") if isinstance(body.get("model"), str) else None
        deadline = asyncio.get_running_loop().time() + self.settings.cold_start_timeout_s
        held = False
        try:
            while True:
                response, starting = await self.try_engines(request, raw, body, model)
                waiting = starting and self.pool.is_known(model)
                if not waiting or asyncio.get_running_loop().time() >= deadline:
                    break
                if not held:
                    held = True
                    self.metrics.held.labels(model or "").inc()
                await asyncio.sleep(min(self.settings.scrape_interval_s, 1.0))
        finally:
            if held:
                self.metrics.held.labels(model or "").dec()
        if held and starting:
            timeout = self.settings.cold_start_timeout_s
            self.metrics.unrouted.labels(model or "", "cold_start_timeout").inc()
            return error(503, f"no engine of `{model}` came up within {timeout:g}s (it may be "
                         "starting from zero replicas): try again", headers={"Retry-After": "10"})
        return response

    async def try_engines(
        self, request: Request, raw: bytes, body: dict[str, Any], model: str | None
    ) -> tuple[Response, bool]:
        """The answer, and whether no engine is up yet: each one tried was unreachable or
        answered 503 (not ready); an engine that answered 429 is up, only busy."""
        candidates = self.pool.serving(model)
        if not candidates:
            return self.no_backend(model), self.pool.is_known(model)
        assert self.client is not None
        busy = False
        headers = self.outgoing_headers(request)
        last: Response | None = None
        for attempt, backend in enumerate(self.order(candidates, body)):
            if attempt:
                self.metrics.retries.labels(model or "").inc()
            upstream = self.client.build_request(
                "POST", backend.url + request.url.path, content=raw, headers=headers,
                params=request.query_params,
            )  # fmt: skip
            self._enter(backend)
            try:
                response = await self.client.send(upstream, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                self._leave(backend, model, "connect_error")
                backend.healthy, backend.last_error = False, str(exc) or type(exc).__name__
                last = error(503, f"engine {backend.url} unreachable: {backend.last_error}")
                continue
            except httpx.HTTPError as exc:  # started, then failed: not retried
                self._leave(backend, model, "upstream_error")
                message = f"engine {backend.url} failed: {type(exc).__name__}: {exc}"
                return error(502, message), False
            busy = busy or response.status_code != 503
            if response.status_code in RETRIED_STATUSES:
                last = await self._buffered(response)
                self._leave(backend, model, str(response.status_code))
                continue
            done = functools.partial(self._leave, backend, model)
            return RelayResponse(response, done), False
        assert last is not None
        if busy:
            self.metrics.unrouted.labels(model or "", "all_refused").inc()
        return last, not busy

    def no_backend(self, model: str | None) -> JSONResponse:
        served = self.pool.models()
        if model is not None and model not in served and not self.pool.is_known(model):
            self.metrics.unrouted.labels(model, "unknown_model").inc()
            return error(
                404,
                f"The model `{model}` does not exist; this router serves "
                f"{', '.join(served) or 'no model yet'}.",
                param="model", code="model_not_found",
            )  # fmt: skip
        if model is None and len(served) > 1:
            return error(400, f"name a model: this router serves {', '.join(served)}",
                         param="model")  # fmt: skip
        self.metrics.unrouted.labels(model or "", "no_backend").inc()
        return error(503, f"no engine serves `{model or 'a model'}` right now",
                     headers={"Retry-After": "5"})  # fmt: skip

    async def _buffered(self, response: httpx.Response) -> Response:
        """A refusal, read whole (it is one small JSON) and closed."""
        try:
            content = await response.aread()
        finally:
            await response.aclose()
        headers = {k: v for k, v in response.headers.items() if k.lower() not in DROPPED_HEADERS}
        return Response(content, response.status_code, headers=headers)

    def _enter(self, backend: Backend) -> None:
        backend.in_flight += 1
        self.metrics.in_flight.labels(backend.url).set(backend.in_flight)

    def _leave(self, backend: Backend, model: str | None, outcome: str) -> None:
        backend.in_flight -= 1
        self.metrics.in_flight.labels(backend.url).set(backend.in_flight)
        self.metrics.requests.labels(model or "", backend.url, outcome).inc()


def build_router_app(pool: BackendPool, settings: RouterSettings) -> FastAPI:
    router = Router(pool, settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(None, connect=settings.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            router.client = client
            scrape_client = httpx.AsyncClient(timeout=httpx.Timeout(5.0))
            await pool.scrape_once(scrape_client)
            scraping = pool.scrape_forever(scrape_client, settings.scrape_interval_s)
            task = asyncio.create_task(scraping)
            try:
                yield
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await scrape_client.aclose()

    app = FastAPI(title="pagoda router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = router

    def unauthorized(request: Request) -> JSONResponse | None:
        if settings.api_key is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(
            token.encode(), settings.api_key.encode()
        ):
            return None
        return error(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                     code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip

    async def proxied(request: Request) -> Response:
        refused = unauthorized(request)
        if refused is not None:
            return refused
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > settings.max_body_bytes:
            return error(413, f"request body over {settings.max_body_bytes} bytes")
        raw = await request.body()
        if len(raw) > settings.max_body_bytes:
            return error(413, f"request body over {settings.max_body_bytes} bytes")
        try:
            body = json.loads(raw or b"{}")
        except ValueError as exc:
            return error(400, f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        return await router.forward(request, raw, body)

    for path in PROXIED_POSTS:
        app.add_api_route(path, proxied, methods=["POST"], include_in_schema=False)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        refused = unauthorized(request)
        if refused is not None:
            return refused
        cards = [{"id": m, "object": "model", "owned_by": "pagoda"} for m in pool.models()]
        return JSONResponse({"object": "list", "data": cards})

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        """Ready while some engine answers: a router with none can only say 503."""
        if any(b.healthy and b.models for b in pool.backends.values()):
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "no engine answers"}, status_code=503)

    @app.get("/router/backends")
    async def backends() -> dict[str, Any]:
        return {"backends": [
            {"url": b.url, "models": sorted(b.models), "healthy": b.healthy,
             "in_flight": b.in_flight, "waiting": b.waiting, "running": b.running,
             "kv_cache_usage": b.kv_cache_usage, "last_error": b.last_error}
            for b in pool.backends.values()
        ]}  # fmt: skip

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(404)
    async def not_found(_: Request, __: Exception) -> JSONResponse:
        return error(404, "no such route")

    @app.exception_handler(405)
    async def not_allowed(_: Request, __: Exception) -> JSONResponse:
        return error(405, "method not allowed")

    return app
