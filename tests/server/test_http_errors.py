"""Errors a client can cause get an OpenAI-shaped 4xx, never a 5xx or a stack trace."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from server_harness import TINY_MAX_MODEL_LEN, ServerThread, wait_until_gone


def assert_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.base_url, timeout=60) as client:
        yield client


def test_malformed_json_is_400(http):
    response = http.post(
        "/v1/completions", content=b'{"prompt": "hi",', headers={"content-type": "application/json"}
    )
    assert "JSON" in assert_error(response, 400)["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "prompt"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
        ({"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids.0"),
        ({"prompt": [-5, 3]}, None),
        ({"prompt": "hi", "seed": 2**70}, "seed"),
        ({"prompt": "hi", "top_k": -2}, "top_k"),
        ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_parameters_are_400(http, body, param):
    error = assert_error(http.post("/v1/completions", json=body), 400)
    if param is not None:
        assert error["param"].startswith(param)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": ""},
        {"prompt": []},
        {"prompt": "hi", "min_tokens": 20, "max_tokens": 10},
        {"prompt": "hi", "stop": [""]},
        {"prompt": "hi", "logit_bias": {"10000000": 1.0}},  # outside the vocabulary
        {"prompt": [1, 2, 10_000_000]},
        {"prompt": "hi", "stop_token_ids": [10_000_000]},
        {"prompt": "hi", "n": 9},  # more than max_num_seqs
    ],
)
def test_semantically_invalid_requests_are_400(http, body):
    assert_error(http.post("/v1/completions", json=body), 400)


@pytest.mark.parametrize(
    "url, body, param",
    [
        ("/v1/completions", r'{"prompt": "a\ud800b"}', "prompt"),
        ("/v1/completions", r'{"prompt": ["ok", "a\udfffb"]}', "prompt.1"),
        ("/v1/completions", r'{"prompt": "hi", "stop": ["\ud800"]}', "stop.0"),
        ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "a\ud800b"}]}',
         "messages.0.content"),
        ("/tokenize", r'{"prompt": "a\ud800b"}', "prompt"),
    ],
)  # fmt: skip
def test_lone_surrogate_is_400_naming_the_field(http, url, body, param):
    """JSON can carry a lone UTF-16 surrogate that no tokenizer or encoder takes."""
    headers = {"content-type": "application/json"}
    error = assert_error(http.post(url, content=body.encode(), headers=headers), 400)
    assert error["param"] == param
    assert "surrogate" in error["message"]
    assert http.get("/health").status_code == 200


def test_validation_errors_name_fields_not_classes(http):
    url = "/v1/chat/completions"
    message = {"role": "user", "content": "hi"}
    error = assert_error(http.post(url, json={"messages": [message], "tool_choice": "auto"}), 400)
    assert error["param"] == "tool_choice" and "tools" in error["message"]
    body = {"messages": [message], "stream": True, "stream_options": "yes"}
    error = assert_error(http.post(url, json=body), 400)
    assert error["param"] == "stream_options" and "StreamOptions" not in error["message"]
    error = assert_error(http.post(url, json={"messages": ["hi"]}), 400)
    assert error["param"] == "messages.0" and "ChatMessage" not in error["message"]
    bad_part = {"role": "user", "content": [{"type": "image_url"}]}
    error = assert_error(http.post(url, json={"messages": [bad_part]}), 400)
    assert "[" not in error["param"], error  # no union member names such as list[...]


def test_chat_errors_are_400(http):
    url = "/v1/chat/completions"
    assert_error(http.post(url, json={"messages": []}), 400)
    assert_error(http.post(url, json={"messages": [{"role": "user"}], "top_logprobs": 2}), 400)
    bad_part = {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}
    assert_error(http.post(url, json={"messages": [bad_part]}), 400)


def test_prompt_plus_max_tokens_over_limit_names_both(http):
    prompt = "The quick brown fox. " * 4
    num_prompt = len(http.post("/tokenize", json={"prompt": prompt}).json()["tokens"])
    assert 0 < num_prompt < TINY_MAX_MODEL_LEN // 2
    max_tokens = TINY_MAX_MODEL_LEN - num_prompt + 1
    error = assert_error(
        http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens}), 400
    )
    assert str(TINY_MAX_MODEL_LEN) in error["message"]
    assert str(max_tokens) in error["message"]
    assert str(num_prompt) in error["message"]
    ok = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens - 1})
    assert ok.status_code == 200
    assert ok.json()["usage"]["total_tokens"] <= TINY_MAX_MODEL_LEN


def test_prompt_over_limit_is_400(http):
    error = assert_error(
        http.post("/v1/completions", json={"prompt": [5] * (TINY_MAX_MODEL_LEN + 1)}), 400
    )
    assert str(TINY_MAX_MODEL_LEN) in error["message"]


def test_unknown_model_is_404(http):
    for url, body in [
        ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}),
        (
            "/v1/chat/completions",
            {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]},
        ),
    ]:
        error = assert_error(http.post(url, json=body), 404)
        assert "gpt-4" in error["message"]
        assert error["param"] == "model"


def test_every_served_name_is_accepted(http):
    for name in ("tiny", "tiny-alias"):
        body = {"model": name, "prompt": "hi", "max_tokens": 1}
        assert http.post("/v1/completions", json=body).status_code == 200


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_probes(http):
    assert http.get("/health").status_code == 200
    assert http.get("/ready").status_code == 200


def test_api_key_required_on_v1(tiny_model):
    server = ServerThread(tiny_model, api_key="s3cret", num_kv_blocks=32).start()
    engine_pid = server.engine.engine_pid
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            body = {"prompt": "hi", "max_tokens": 1}
            assert_error(http.post("/v1/completions", json=body), 401)
            assert_error(http.get("/v1/models", headers={"Authorization": "Bearer nope"}), 401)
            auth = {"Authorization": "Bearer s3cret"}
            assert http.post("/v1/completions", json=body, headers=auth).status_code == 200
            assert http.get("/v1/models", headers=auth).status_code == 200
            # Probes and metrics stay open: kubelet and Prometheus carry no token.
            assert http.get("/health").status_code == 200
            assert http.get("/ready").status_code == 200
            assert http.get("/metrics").status_code == 200
    finally:
        server.stop()
    # Stopping the server stops its engine process too (test_sigterm checks `pagoda serve`).
    assert wait_until_gone(engine_pid, 5)


def test_full_queue_is_429_with_retry_after(tiny_model):
    server = ServerThread(tiny_model, max_num_seqs=1, max_queue_len=1, num_kv_blocks=32).start()
    long_body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            running = asyncio.create_task(client.post("/v1/completions", json=long_body))
            queued = asyncio.create_task(client.post("/v1/completions", json=long_body))
            for _ in range(600):  # until the engine has one running and one waiting
                stats = server.engine.stats
                if stats.num_running == 1 and stats.num_waiting == 1:
                    break
                await asyncio.sleep(0.05)
            response = await client.post("/v1/completions", json={"prompt": "hi"})
            assert_error(response, 429)
            assert int(response.headers["retry-after"]) >= 1
            running.cancel()
            queued.cancel()
            await asyncio.gather(running, queued, return_exceptions=True)

    try:
        asyncio.run(scenario())
        server.wait_idle()
        response = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hi"})
        assert response.status_code == 200, "the queue drains once requests go away"
    finally:
        server.stop()


def test_the_unicode_check_skips_numbers():
    """A body's bulk is token ids: the lone-surrogate check walks its strings only (it once
    built a dotted path for each of a prompt's ids, two thirds of a request's parse time)."""
    from inference.server import protocol

    calls = {"n": 0}
    real = protocol._lone_surrogate_path

    def counted(value, path):
        calls["n"] += 1
        return real(value, path)

    body = {"prompt": list(range(100_000)), "logit_bias": {"7": 1.5}, "stop": ["é"]}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(protocol, "_lone_surrogate_path", counted)
        request = protocol.CompletionRequest.model_validate(body)
        assert len(request.prompt) == 100_000 and calls["n"] == 1
        bad = {**body, "stop": ["ok", "\ud800"]}
        with pytest.raises(ValueError, match=r"stop\.1: contains a lone UTF-16 surrogate"):
            protocol.CompletionRequest.model_validate(bad)
