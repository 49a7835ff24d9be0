"""The engines behind the router: which models each serves, its load, whether it answers.

Backends come from ``--backend [MODEL=]URL`` flags, and from Kubernetes (``kubernetes``:
the ready endpoints of the LLMDeployments' Services, re-read at every scrape). With a model
named, the engine serves it; without, its ``GET /v1/models`` says (adapters included),
re-read at every scrape. Every
``scrape_interval_s`` the router reads each engine's ``/metrics`` for the vLLM gauges the
least-load fallback ranks by; an engine that does not answer is left out of picking until
it does (unless no engine answers: then every one is tried, and the retries tell).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import httpx

from inference.router.kubernetes import KubeSource, deployed_models, engine_urls
from inference.router.picking import EngineLoad, Ring

logger = logging.getLogger(__name__)

# vLLM's gauge names (pagoda's server keeps them: tests/k8s/test_gateway_protocol.py).
GAUGES = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
}


@dataclass
class Backend:
    url: str
    models: set[str] = field(default_factory=set)
    discover_models: bool = False  # models from GET /v1/models rather than the flag
    discovered: bool = False  # found in Kubernetes (and dropped once its endpoint goes)
    in_flight: int = 0
    waiting: float = 0.0
    running: float = 0.0
    kv_cache_usage: float = 0.0
    healthy: bool = True
    last_error: str = ""

    def load(self) -> EngineLoad:
        return EngineLoad(self.in_flight, self.waiting, self.running, self.kv_cache_usage)

    def requests(self) -> int:
        """Requests on this engine, as bounded load counts them: the router's own in flight,
        or what the engine last reported running and waiting when that is more (other
        routers' and clients' requests); the count is fresher, the report more complete."""
        return max(self.in_flight, round(self.running + self.waiting))


def parse_backend(flag: str) -> tuple[str | None, str]:
    """``MODEL=URL`` or ``URL`` -> (model or None, URL without a trailing slash)."""
    model, sep, url = flag.partition("=")
    if not sep:
        model, url = "", flag
    if "://" in model:  # `http://host:8000/x?y=z` has no model; its `=` is the URL's
        model, url = "", flag
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--backend {flag!r}: the URL must start with http:// or https://")
    return (model.strip() or None), url


def parse_metrics(text: str) -> dict[str, float]:
    """The gauges of ``GAUGES`` from Prometheus text, summed over their label sets."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in GAUGES:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        values[GAUGES[name]] = values.get(GAUGES[name], 0.0) + value
    return values


class BackendPool:
    """Every backend by URL; rings per model set, rebuilt when the set changes."""

    def __init__(self, flags: list[str], kube: KubeSource | None = None) -> None:
        self.kube = kube
        self.backends: dict[str, Backend] = {}
        for flag in flags:
            model, url = parse_backend(flag)
            backend = self.backends.setdefault(url, Backend(url))
            if model is None:
                backend.discover_models = True
            else:
                backend.models.add(model)
        self._rings: dict[tuple[str, ...], Ring] = {}
        # Every model ever served here: one whose engines all went (scaled to zero) is still
        # known, so its requests are held for a cold start rather than refused as unknown.
        self.known: set[str] = set()

    def models(self) -> list[str]:
        served = {m for b in self.backends.values() for m in b.models}
        self.known |= served
        return sorted(served)

    def is_known(self, model: str | None) -> bool:
        self.models()
        return model is not None and model in self.known

    def serving(self, model: str | None) -> list[Backend]:
        """The backends serving ``model`` (any, when the request names none and one model
        is served), healthy ones only unless none is."""
        if model is None:
            served = self.models()
            model = served[0] if len(served) == 1 else None
        found = [b for b in self.backends.values() if model is not None and model in b.models]
        healthy = [b for b in found if b.healthy]
        return healthy or found

    def ring(self, backends: list[Backend]) -> Ring:
        key = tuple(sorted(b.url for b in backends))
        if key not in self._rings:
            self._rings[key] = Ring.of(key)
        return self._rings[key]

    def sync_discovered(self, urls: set[str]) -> None:
        """Backends found in Kubernetes become ``urls``; flagged ones stay as they are."""
        for url in urls:
            if url not in self.backends:
                self.backends[url] = Backend(url, discover_models=True, discovered=True)
        for url in [u for u, b in self.backends.items() if b.discovered and u not in urls]:
            if self.backends[url].in_flight == 0:  # requests in flight finish on it first
                del self.backends[url]

    async def scrape_once(self, client: httpx.AsyncClient) -> None:
        if self.kube is not None:
            await self._discover(self.kube)
        await asyncio.gather(*(self._scrape(client, b) for b in list(self.backends.values())))

    async def _discover(self, source: KubeSource) -> None:
        try:
            async with source.client() as kube:
                self.sync_discovered(await engine_urls(kube, source))
                try:
                    self.known |= await deployed_models(kube, source)
                except httpx.HTTPStatusError as error:  # no RBAC for it, or no CRD: optional
                    logger.debug("reading LLMDeployments in %s: %s", source.namespace, error)
        except (httpx.HTTPError, ValueError, OSError) as error:
            logger.warning("reading EndpointSlices in %s failed: %s", source.namespace, error)

    async def _scrape(self, client: httpx.AsyncClient, backend: Backend) -> None:
        try:
            response = await client.get(f"{backend.url}/metrics")
            response.raise_for_status()
            for attribute, value in parse_metrics(response.text).items():
                setattr(backend, attribute, value)
            if backend.discover_models:
                listed = await client.get(f"{backend.url}/v1/models")
                listed.raise_for_status()
                backend.models = {card["id"] for card in listed.json().get("data") or []}
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
            if backend.healthy:
                logger.warning("backend %s left out: %s", backend.url, error)
            backend.healthy, backend.last_error = False, str(error) or type(error).__name__
            return
        if not backend.healthy:
            logger.info("backend %s answers again", backend.url)
        backend.healthy, backend.last_error = True, ""

    async def scrape_forever(self, client: httpx.AsyncClient, interval_s: float) -> None:
        while True:
            await self.scrape_once(client)
            await asyncio.sleep(interval_s)
