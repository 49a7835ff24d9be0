"""vLLM's API extras: logit_bias, /version, HEAD /health, CORS, X-Request-Id,
continuous_usage_stats; and no /docs page that would load scripts from a CDN."""

from __future__ import annotations

import json

import httpx
import pytest
from server_harness import ServerThread

from inference.server.app import CorsSettings


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.base_url, timeout=60) as client:
        yield client


def sse_payloads(response: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_logit_bias_forces_and_bans_tokens(http):
    body = {"prompt": "hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    token_text = http.post("/detokenize", json={"tokens": [42]}).json()["prompt"]
    forced = http.post("/v1/completions", json={**body, "logit_bias": {"42": 100}})
    assert forced.status_code == 200, forced.text
    assert forced.json()["choices"][0]["text"] == token_text * 4
    one = {**body, "max_tokens": 1, "logprobs": 0}
    plain = http.post("/v1/completions", json=one).json()["choices"][0]
    best = plain["logprobs"]["tokens"][0]
    ids = http.post("/tokenize", json={"prompt": best, "add_special_tokens": False}).json()
    assert ids["count"] == 1, ids
    banned = {**one, "logit_bias": {str(ids["tokens"][0]): -100}}
    other = http.post("/v1/completions", json=banned).json()["choices"][0]
    assert other["logprobs"]["tokens"][0] != best


def test_version_and_head_health(http):
    assert http.get("/version").json()["version"]
    head = http.head("/health")
    assert head.status_code == 200 and head.content == b""


def test_no_docs_page_loading_scripts_from_a_cdn(http):
    assert http.get("/docs").status_code == 404
    assert http.get("/redoc").status_code == 404
    assert http.get("/openapi.json").status_code == 200


def test_request_id_header_is_echoed_and_used(http):
    body = {"prompt": "hi", "max_tokens": 2}
    response = http.post("/v1/completions", json=body, headers={"X-Request-Id": "trace-42"})
    assert response.headers["x-request-id"] == "trace-42"
    assert response.json()["id"] == "cmpl-trace-42"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    with http.stream(
        "POST", "/v1/chat/completions", json=chat, headers={"X-Request-Id": "trace-43"}
    ) as streamed:
        assert streamed.headers["x-request-id"] == "trace-43"
        assert {p["id"] for p in sse_payloads(streamed)} == {"chatcmpl-trace-43"}
    fresh = http.post("/v1/completions", json=body)
    assert fresh.json()["id"] == f"cmpl-{fresh.headers['x-request-id']}"
    bad = http.post("/v1/completions", json=body, headers={"X-Request-Id": "x" * 300})
    assert bad.status_code == 400 and "X-Request-Id" in bad.json()["error"]["message"]


@pytest.mark.parametrize("url", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats(http, url):
    body = {"max_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    if url == "/v1/completions":
        body["prompt"] = "hello there"
    else:
        body["messages"] = [{"role": "user", "content": "hello there"}]
    with http.stream("POST", url, json=body) as response:
        payloads = sse_payloads(response)
    usages = [p["usage"] for p in payloads]
    assert all(u is not None for u in usages), usages
    completion_tokens = [u["completion_tokens"] for u in usages]
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] == 5
    assert len({u["prompt_tokens"] for u in usages}) == 1
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)


def test_cors_flags(tiny_model):
    cors = CorsSettings(allowed_origins=["https://app.example"], allowed_methods=["POST"])
    server = ServerThread(tiny_model, num_kv_blocks=32, app_kwargs={"cors": cors}).start()
    try:
        preflight = {
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        }
        allowed = httpx.options(f"{server.base_url}/v1/completions", headers=preflight)
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        other = {**preflight, "Origin": "https://evil.example"}
        refused = httpx.options(f"{server.base_url}/v1/completions", headers=other)
        assert "access-control-allow-origin" not in refused.headers
        simple = httpx.get(f"{server.base_url}/health", headers={"Origin": "https://app.example"})
        assert simple.headers["access-control-allow-origin"] == "https://app.example"
    finally:
        server.stop()
