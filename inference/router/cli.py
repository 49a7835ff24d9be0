"""``pagoda router --backend [MODEL=]URL ...``: the router's command line."""

from __future__ import annotations

import argparse
import os

from inference.router.backends import BackendPool
from inference.router.kubernetes import ENGINE_SELECTOR, KubeSource
from inference.router.proxy import RouterSettings, build_router_app

API_KEY_ENV = "PAGODA_API_KEY"  # as for `pagoda serve`: a key kept out of the process list


def add_router_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--backend", action="append", default=[], metavar="[MODEL=]URL",
        help="an engine: MODEL=http://host:8000 serves MODEL; a bare URL says what it serves "
        "through its /v1/models (re-read every scrape). Repeat for each engine.",
    )  # fmt: skip
    parser.add_argument(
        "--discover-namespace", default=None, metavar="NAMESPACE",
        help="also route to every ready engine of the LLMDeployments in NAMESPACE (their "
        "Services' EndpointSlices, read with the pod's service account)",
    )  # fmt: skip
    parser.add_argument("--discover-selector", default=ENGINE_SELECTOR,
                        help="label selector of the engines' EndpointSlices")
    parser.add_argument("--kube-api", default=None,
                        help="the Kubernetes API's URL, outside a pod (no credentials sent)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument(
        "--policy", choices=["prefix", "least-load", "round-robin"], default="prefix",
        help="prefix: a conversation stays on one engine (consistent hashing with bounded "
        "load), least-load for requests without a prefix; least-load: by in-flight requests "
        "and the engines' queue and KV-cache gauges; round-robin: for comparison",
    )  # fmt: skip
    parser.add_argument(
        "--balance", type=float, default=1.25,
        help="bounded-load factor (> 1): an engine takes a conversation's turn while it "
        "carries at most this many times its share of the requests in flight",
    )  # fmt: skip
    parser.add_argument("--prefix-chars", type=int, default=2048,
                        help="characters of the opening turn that make a conversation's key")
    parser.add_argument("--max-attempts", type=int, default=3,
                        help="engines tried for a request that none started")
    parser.add_argument(
        "--cold-start-timeout", type=float, default=0.0, metavar="SECONDS",
        help="hold a request for a model whose engines are all down (scaled to zero, or "
        "starting) this long for one to come up, then answer 503; 0 answers at once",
    )  # fmt: skip
    parser.add_argument("--scrape-interval", type=float, default=2.0,
                        help="seconds between reads of every engine's /metrics")
    parser.add_argument("--api-key", default=None,
                        help=f"clients must send it as a Bearer token (or set {API_KEY_ENV})")
    parser.add_argument("--backend-api-key", default=None,
                        help="sent to the engines instead of the client's Authorization")
    parser.add_argument("--uvicorn-log-level", default="warning",
                        choices=["debug", "info", "warning", "error"])
    return parser


def settings_from(args: argparse.Namespace) -> RouterSettings:
    if args.balance <= 1.0:
        raise ValueError(f"--balance must be > 1 (got {args.balance})")
    if args.max_attempts < 1:
        raise ValueError(f"--max-attempts must be >= 1 (got {args.max_attempts})")
    return RouterSettings(
        policy=args.policy,
        balance=args.balance,
        prefix_chars=args.prefix_chars,
        max_attempts=args.max_attempts,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        backend_api_key=args.backend_api_key,
        scrape_interval_s=args.scrape_interval,
        cold_start_timeout_s=args.cold_start_timeout,
    )


def backend_pool(args: argparse.Namespace) -> BackendPool:
    if not args.backend and not args.discover_namespace:
        raise ValueError("name the engines: --backend [MODEL=]URL, or --discover-namespace")
    kube = None
    if args.discover_namespace:
        kube = KubeSource(args.discover_namespace, args.discover_selector, args.kube_api)
    return BackendPool(args.backend, kube)


def run_router(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    # One line per proxied request would drown the router's own warnings.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app = build_router_app(backend_pool(args), settings_from(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0
