"""What a vLLM user expects of the running server: "model": "default", the model's
generation-config defaults, --max-logprobs, --response-role, --return-tokens-as-token-ids,
request logging cut to --max-log-len, --root-path, TLS, and a warning when the chat
template drops the request's tools (the embedded model's template does not)."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest
from server_harness import ROOT, ServerThread, free_port

from inference.server.chat import WARNING_HEADER, ChatServing
from inference.server.protocol import ChatCompletionRequest
from inference.server.serving import ServingOptions

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}}]  # fmt: skip
CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def model_with_defaults(tiny_model, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny_gen") / "model"
    shutil.copytree(tiny_model, folder)
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    return str(folder)


@pytest.fixture(scope="module")
def server(model_with_defaults):
    options = ServingOptions(response_role="bot", return_tokens_as_token_ids=True,
                             log_requests=True, max_log_len=5)
    srv = ServerThread(
        model_with_defaults, served_model_names=["tiny"], max_model_len=256,
        num_kv_blocks=64, max_num_seqs=4, max_logprobs=2,
        app_kwargs={"options": options, "root_path": "/llm"},
    ).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def test_default_is_an_alias_of_the_served_model(http) -> None:
    response = http.post("/v1/chat/completions", json={**CHAT, "model": "default"})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "tiny"


def test_generation_config_max_new_tokens_is_the_default_max_tokens(http) -> None:
    body = {"prompt": "hello", "ignore_eos": True}
    usage = http.post("/v1/completions", json=body).json()["usage"]
    assert usage["completion_tokens"] == 3
    # As vLLM: the generation config's max_new_tokens caps what a request asks for.
    fewer = http.post("/v1/completions", json={**body, "max_tokens": 2}).json()["usage"]
    assert fewer["completion_tokens"] == 2
    more = http.post("/v1/completions", json={**body, "max_tokens": 5}).json()["usage"]
    assert more["completion_tokens"] == 3


def test_max_logprobs_caps_logprobs_with_a_400(http) -> None:
    chat = http.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 3})
    assert chat.status_code == 400
    assert chat.json()["error"]["param"] == "top_logprobs"
    assert "--max-logprobs" in chat.json()["error"]["message"]
    completion = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1,
                                                    "logprobs": 3})
    assert completion.status_code == 400 and completion.json()["error"]["param"] == "logprobs"
    ok = http.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2})
    assert ok.status_code == 200, ok.text


def test_response_role_and_tokens_as_token_ids(http) -> None:
    body = {**CHAT, "logprobs": True, "top_logprobs": 1}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["message"]["role"] == "bot"
    entry = choice["logprobs"]["content"][0]
    assert entry["token"].startswith("token_id:") and entry["token"][9:].isdigit()
    assert entry["top_logprobs"][0]["token"].startswith("token_id:")


def test_requests_are_logged_cut_to_max_log_len(http, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="inference.server.requests"):
        http.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 1})
    lines = [r.getMessage() for r in caplog.records if "received request" in r.getMessage()]
    assert lines and "prompt: 'hello'," in lines[-1]


def test_root_path_reaches_the_openapi_schema(http) -> None:
    assert http.get("/openapi.json").json()["servers"] == [{"url": "/llm"}]


def test_tools_a_template_ignores_get_a_warning(http) -> None:
    # The tiny model's template renders no tools: the model is never told about them.
    body = {**CHAT, "tools": TOOLS, "tool_choice": "none"}
    warned = http.post("/v1/chat/completions", json=body)
    assert warned.status_code == 200
    assert "ignores tools" in warned.headers[WARNING_HEADER]
    assert WARNING_HEADER not in http.post("/v1/chat/completions", json=CHAT).headers


def test_the_embedded_models_template_shows_the_tools(smol_model) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smol_model)
    engine = SimpleNamespace(tokenizer=tokenizer,
                             engine=SimpleNamespace(tokenizer_path=smol_model))
    chat = ChatServing(engine, ["m"])
    req = ChatCompletionRequest(messages=CHAT["messages"], tools=TOOLS, tool_choice="none")
    prompt = chat.prepare_prompt(req)
    assert "<tools>" in prompt.text and '"get_weather"' in prompt.text
    assert "<tool_call>" in prompt.text and prompt.warnings == []
    # Without tools, exactly what the model's own template renders.
    own = tokenizer.apply_chat_template(CHAT["messages"], tokenize=False,
                                        add_generation_prompt=True)
    assert chat.render_chat(req.messages) == own


def test_tls_with_ssl_flags(tiny_model, tmp_path) -> None:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    key_path, cert_path, ca_path = tmp_path / "k.pem", tmp_path / "c.pem", tmp_path / "ca.pem"
    cert.private_key_pem.write_to_path(key_path)
    cert.cert_chain_pems[0].write_to_path(cert_path)
    ca.cert_pem.write_to_path(ca_path)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "inference.server.cli_serve", "--model", tiny_model,
         "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
         "--max-model-len", "128", "--num-kv-blocks", "16", "--disable-uvicorn-access-log",
         "--ssl-keyfile", str(key_path), "--ssl-certfile", str(cert_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        with httpx.Client(verify=str(ca_path), timeout=5) as client:
            while time.monotonic() < deadline:
                assert proc.poll() is None, proc.communicate()[0]
                try:
                    if client.get(f"https://127.0.0.1:{port}/ready").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
            answer = client.post(f"https://127.0.0.1:{port}/v1/completions", timeout=60,
                                 json={"prompt": "hi", "max_tokens": 1})
            assert answer.status_code == 200, answer.text
    finally:
        proc.terminate()
        proc.wait(timeout=60)
