"""`spec.prometheus` credentials: the tuner reads a bearer token and a CA bundle from Secrets
and talks to an HTTPS Prometheus API that refuses requests without the token (as managed
Prometheus services and authenticating proxies do). The server is a local stand-in that
answers every query with one sample; its certificate comes from a throwaway CA (trustme).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import trustme
from pagoda_operator.tuning import runner
from pagoda_operator.tuning.prometheus import PrometheusEndpoint, observe

from .test_tuner_parts import FakeApi, spec

TOKEN = "s3cret-token"
SECRETS = "/api/v1/namespaces/ns/secrets"


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def prometheus(ca: trustme.CA) -> Iterator[str]:
    """HTTPS on 127.0.0.1; 401 without ``Authorization: Bearer TOKEN``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                self.reply(401, b"Unauthorized\n", "text/plain")
                return
            sample = {"metric": {"max_num_seqs": "4"}, "value": [0, "2"]}
            body = {"status": "success", "data": {"resultType": "vector", "result": [sample]}}
            self.reply(200, json.dumps(body).encode(), "application/json")

        def reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def ca_pem(ca: trustme.CA) -> str:
    return ca.cert_pem.bytes().decode()


def test_token_and_ca_get_a_snapshot(prometheus: str, ca: trustme.CA) -> None:
    endpoint = PrometheusEndpoint(prometheus, bearer_token=TOKEN, ca_pem=ca_pem(ca))
    observation = asyncio.run(observe(endpoint, "ns", "qwen2-5-7b", 60))
    assert observation.problem == "" and observation.snapshot is not None
    assert observation.snapshot.pods == 2


def test_without_the_token_the_tuner_says_it_was_refused(prometheus: str, ca: trustme.CA) -> None:
    observation = asyncio.run(
        observe(PrometheusEndpoint(prometheus, ca_pem=ca_pem(ca)), "ns", "m", 60)
    )
    assert observation.snapshot is None and observation.reason == "Unauthorized"
    assert "HTTP 401" in observation.problem


def test_without_the_ca_the_certificate_is_not_trusted(prometheus: str) -> None:
    observation = asyncio.run(
        observe(PrometheusEndpoint(prometheus, bearer_token=TOKEN), "ns", "m", 60)
    )
    assert observation.snapshot is None and observation.reason == "Unreachable"
    assert "certificate" in observation.problem.lower()


def test_a_ca_bundle_that_is_not_pem_is_a_clear_condition() -> None:
    endpoint = PrometheusEndpoint("https://127.0.0.1:1", ca_pem="not a certificate")
    observation = asyncio.run(observe(endpoint, "ns", "m", 60))
    assert observation.reason == "CredentialsInvalid"


class SecretsApi(FakeApi):
    """The LLMDeployment and the Secrets of its namespace."""

    def __init__(self, llmd: dict[str, Any], secrets: dict[str, dict[str, str]]) -> None:
        super().__init__(llmd)
        self.secrets = secrets

    async def get(self, path: str) -> dict[str, Any] | None:
        if not path.startswith(SECRETS + "/"):
            return await super().get(path)
        self.calls.append(("GET", path, None))
        data = self.secrets.get(path.removeprefix(SECRETS + "/"))
        if data is None:
            return None
        return {"data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}


def tuner_window(url: str, secrets: dict[str, dict[str, str]]) -> dict[str, Any]:
    prometheus = {
        "url": url,
        "bearerTokenSecretRef": {"name": "prometheus-token", "key": "token"},
        "caSecretRef": {"name": "prometheus-ca", "key": "ca.crt"},
    }
    llmd = {
        "metadata": {"name": "m", "namespace": "ns"},
        "spec": {**spec(mode="Recommend"), "prometheus": prometheus},
    }
    api = SecretsApi(llmd, secrets)

    async def apply_owned(_: dict[str, Any]) -> None:
        raise AssertionError("Recommend applies nothing")

    asyncio.run(
        runner.tune(
            api,  # type: ignore[arg-type]
            llmd,
            emit=lambda *_: None,
            logger=logging.getLogger("test"),
            window_s=60,
            apply_owned=apply_owned,
        )
    )
    status = api.llmd["status"]
    return next(c for c in status["conditions"] if c["type"] == "MetricsAvailable")


def test_the_tuner_reads_the_token_and_ca_from_secrets(prometheus: str, ca: trustme.CA) -> None:
    secrets = {
        "prometheus-token": {"token": TOKEN + "\n"},  # as `kubectl create secret --from-file`
        "prometheus-ca": {"ca.crt": ca_pem(ca)},
    }
    condition = tuner_window(prometheus, secrets)
    assert (condition["status"], condition["reason"]) == ("True", "SeriesPresent")


def test_a_missing_secret_holds_the_knobs_and_says_which(prometheus: str) -> None:
    condition = tuner_window(prometheus, {"prometheus-ca": {"ca.crt": "x"}})
    assert (condition["status"], condition["reason"]) == ("False", "CredentialsMissing")
    assert "Secret ns/prometheus-token not found" in condition["message"]
