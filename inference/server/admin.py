"""The admin API: the engine's live settings and its LoRA adapters, for the operator.

Off by default. ``pagoda serve --admin-port PORT`` turns it on, and then it needs a key of
its own (``--admin-api-key``, default ``$PAGODA_ADMIN_API_KEY``): never the clients'
``--api-key``, which every client holds; the serve command refuses the two being equal.

Why a port of its own rather than a path on the serving port: whatever exposes the serving
port (the Service, an Ingress or gateway in front of it) would expose a path under it to
every client, so the key alone would guard it. The admin port is declared on the pod but no
Service routes to it; only what reaches the pod's address directly (the operator, and a
NetworkPolicy can narrow that to its namespace) can even try the key.

- ``GET /admin/engine-config``: the live settings and what changing each costs from here
  (up to which value no CUDA graph is captured, below how many KV blocks a shrink
  preempts); with settings as query parameters (``?max_num_seqs=512``), the plan of that
  change as well (nothing is changed).
- ``POST /admin/engine-config`` with a JSON object of settings: applies the change between
  two engine steps and answers once it is in effect (200, with what it took: a change past
  the captured CUDA graphs waits for the missing ones, captured in the background while the
  engine steps on under the old limits), or why not: 422 for a value the engine cannot run,
  409 for one it cannot take live (restart with the flag instead; also a capture that
  failed, and a change sent while another one waits for its graphs: one at a time, send
  it again once the first has answered), 503 while the engine loads or after it failed.

- ``GET /admin/lora-adapters``: the adapters served now (name, path, base model), and
  whether the server runs with ``--enable-lora``.
- ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``: vLLM's runtime adapter
  routes, bodies and answers (400 for an adapter that cannot be served, saying why; 404 to
  unload one that is not loaded), here whatever ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` says: the
  key is the privilege. The serving port offers them only with that opt-in, as vLLM does.
  The operator loads and unloads an LLMDeployment's ``spec.adapters`` through them.

Settings use the engine's names (``max_num_seqs``, ``max_num_batched_tokens``,
``num_kv_blocks``, ``gpu_memory_utilization``); ``pagoda:engine_config_info`` and
``vllm:cache_config_info`` on the serving port's /metrics follow every change.
"""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from inference.async_engine import AsyncLLMEngine, EngineDeadError, EngineNotReadyError
from inference.engine_messages import Reconfigured
from inference.server.app import add_lora_routes
from inference.server.errors import APIError, error_body, install_error_handlers
from inference.server.lora_modules import ServedAdapters

_bearer = HTTPBearer(auto_error=False, description="The server's --admin-api-key.")


def _admin_key_check(admin_key: str):
    async def check(
        credentials: HTTPAuthorizationCredentials | None = Depends(_bearer),  # noqa: B008
    ) -> None:
        token = credentials.credentials if credentials else ""
        if not secrets.compare_digest(token.encode(), admin_key.encode()):
            raise APIError(
                401, "missing or invalid admin key: send 'Authorization: Bearer <admin key>'",
                code="invalid_admin_key", headers={"WWW-Authenticate": "Bearer"},
            )  # fmt: skip

    return check


def build_admin_app(
    engine: AsyncLLMEngine, admin_key: str, adapters: ServedAdapters | None = None
) -> FastAPI:
    """The admin routes over ``engine`` and the serving app's ``adapters`` (its
    ``app.state.adapters``; none: LoRA is off), all behind ``admin_key``. It has no lifespan:
    the serving app starts and stops the engine."""
    if not admin_key:
        raise ValueError("the admin API needs a key (--admin-api-key or $PAGODA_ADMIN_API_KEY)")
    app = FastAPI(title="pagoda admin", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    authenticated = [Depends(_admin_key_check(admin_key))]

    @app.get("/admin/engine-config", dependencies=authenticated)
    async def show(request: Request) -> JSONResponse:
        changes = {name: _query_value(value) for name, value in request.query_params.items()}
        return _answer(await _ask(engine, changes, dry_run=True))

    @app.post("/admin/engine-config", dependencies=authenticated)
    async def change(request: Request) -> JSONResponse:
        try:
            changes = await request.json()
        except ValueError:
            raise APIError(422, "the body must be a JSON object of settings") from None
        if not isinstance(changes, dict) or not changes:
            raise APIError(422, "the body must be a non-empty JSON object of settings, e.g. "
                                '{"max_num_seqs": 512}')
        return _answer(await _ask(engine, changes, dry_run=False))

    served = adapters if adapters is not None else ServedAdapters([])

    @app.get("/admin/lora-adapters", dependencies=authenticated)
    async def lora_adapters() -> JSONResponse:
        return JSONResponse({"enabled": served.enabled, "adapters": served.listing()})

    lora = APIRouter(prefix="/v1", dependencies=authenticated)
    add_lora_routes(lora, engine, served)
    app.include_router(lora)
    return app


async def _ask(engine: AsyncLLMEngine, changes: dict[str, Any], dry_run: bool) -> Reconfigured:
    try:
        return await engine.reconfigure(changes, dry_run=dry_run)
    except (EngineNotReadyError, EngineDeadError) as error:
        raise APIError(503, str(error)) from None
    except TimeoutError:
        raise APIError(503, "the engine did not answer the change in time") from None


def _answer(reply: Reconfigured) -> JSONResponse:
    body = {"settings": reply.settings, "costs": reply.costs}
    if reply.status != 200:
        return JSONResponse({**error_body(reply.status, reply.message), **body},
                            status_code=reply.status)  # fmt: skip
    return JSONResponse({"status": reply.message, **body, "plan": reply.plan,
                         "seconds": round(reply.seconds, 4)})  # fmt: skip


def _query_value(text: str) -> Any:
    """A query parameter's number (the engine says what is wrong with anything else)."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
