"""Fake engines for the router tests: the engine server's routes, each answer naming the
engine, with knobs to hold a stream open or to refuse with 503. Real uvicorn servers on
loopback sockets, in background threads, as the router meets real engines."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(probe: Callable[[], Any], timeout: float = 30.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := probe():
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what or probe}")


class FakeEngine:
    """Counts what it was sent; ``hold`` keeps streams open until ``release``;
    ``refuse`` answers 503 as an engine that is not ready."""

    def __init__(self, name: str, models: tuple[str, ...] = (MODEL,)) -> None:
        self.name = name
        self.models = models
        self.received: list[dict[str, Any]] = []
        self.open_streams = 0
        self.hold = False
        self.refuse = False
        self.waiting_gauge = 0.0
        self._release: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.app = self._build()

    def release(self) -> None:
        assert self.loop is not None and self._release is not None
        self.loop.call_soon_threadsafe(self._release.set)

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            if self.refuse:
                error = {"message": "engine not ready", "type": "service_unavailable_error",
                         "param": None, "code": 503}  # fmt: skip
                return JSONResponse({"error": error}, status_code=503)
            self.received.append(body)
            if self._release is None:
                self._release = asyncio.Event()
            if not body.get("stream"):
                return {"engine": self.name, "choices": [{"message": {"content": "hi"}}]}
            return StreamingResponse(self._events(), media_type="text/event-stream")

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(
                "# TYPE vllm:num_requests_waiting gauge\n"
                f'vllm:num_requests_waiting{{model_name="{MODEL}"}} {self.waiting_gauge}\n'
                f'vllm:num_requests_running{{model_name="{MODEL}"}} {self.open_streams}\n'
                f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.1\n'
            )

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]}

        return app

    async def _events(self):
        self.open_streams += 1
        try:
            yield f"data: {json.dumps({'engine': self.name, 'part': 1})}\n\n".encode()
            if self.hold:
                assert self._release is not None
                await self._release.wait()
            yield f"data: {json.dumps({'engine': self.name, 'part': 2})}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            self.open_streams -= 1


class Served:
    """An ASGI app under uvicorn on 127.0.0.1 in a thread."""

    def __init__(
        self, app: Any, on_loop: Callable[[asyncio.AbstractEventLoop], None] | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self._on_loop = on_loop
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        if self._on_loop is not None:
            self._on_loop(loop)
        loop.run_until_complete(self.server.serve())

    def __enter__(self) -> Served:
        self.thread.start()
        wait_until(lambda: self.server.started, what=f"{self.url} started")
        return self

    def __exit__(self, *_: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def serve_engine(engine: FakeEngine) -> Served:
    def remember(loop: asyncio.AbstractEventLoop) -> None:
        engine.loop = loop

    return Served(engine.app, on_loop=remember)


def chat(client: httpx.Client, conversation: int, turn: int, **extra: Any) -> httpx.Response:
    """Turn ``turn`` of conversation ``conversation``: its opening and every earlier turn."""
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are terse."}]
    messages.append({"role": "user", "content": f"conversation {conversation}: hello"})
    for earlier in range(turn):
        messages.append({"role": "assistant", "content": f"answer {earlier}"})
        messages.append({"role": "user", "content": f"question {earlier + 1}"})
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, **extra})
