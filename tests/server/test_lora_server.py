"""LoRA over HTTP, as vLLM serves it: ``--lora-modules`` (both forms), a request's
``model`` naming an adapter, ``/v1/models`` listing adapters with their parent, runtime
load/unload behind ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, 404 in OpenAI's error shape for an
unknown model, and the ``vllm:lora_requests_info`` gauge."""

from __future__ import annotations

import argparse

import httpx
import pytest
from lora_adapters import build_adapter
from server_harness import ServerThread
from tiny_models import build_tiny_model

from inference.models.config import ModelConfig
from inference.server.cli_serve import add_serve_args, check_serve_args, served_adapters
from inference.server.lora_modules import RUNTIME_UPDATES_ENV, LoRAModule, ServedAdapters

ADMIN_KEY = "the-admin-key"


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora-server")
    hf = build_tiny_model(folder / "base", "llama")
    build_adapter(folder / "sql", hf, rank=8, seed=1)
    build_adapter(folder / "chat", hf, rank=4, seed=2)
    build_adapter(folder / "too-big", hf, rank=32, seed=3)
    return folder


@pytest.fixture(scope="module")
def server(lora_setup):
    patch = pytest.MonkeyPatch()
    patch.setenv(RUNTIME_UPDATES_ENV, "True")
    base = str(lora_setup / "base")
    adapters = ServedAdapters(["tiny"], ModelConfig.from_folder(base), 16, enabled=True)
    adapters.add("sql", str(lora_setup / "sql"))
    thread = ServerThread(
        base, served_model_names=["tiny"], max_model_len=128, num_kv_blocks=64, max_num_seqs=8,
        enable_lora=True, max_loras=2, app_kwargs={"adapters": adapters}, admin_api_key=ADMIN_KEY,
    ).start()
    yield thread
    thread.stop()
    patch.undo()


def _complete(server, model: str) -> httpx.Response:
    body = {"model": model, "prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "temperature": 0,
            "logprobs": 1}  # fmt: skip
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)


def test_models_lists_adapters_with_their_parent(server):
    cards = httpx.get(f"{server.base_url}/v1/models").json()["data"]
    by_id = {card["id"]: card for card in cards}
    assert by_id["tiny"]["parent"] is None
    assert by_id["sql"]["parent"] == "tiny" and by_id["sql"]["root"].endswith("sql")


def test_a_request_naming_an_adapter_runs_with_it(server):
    base, sql = _complete(server, "tiny"), _complete(server, "sql")
    assert base.status_code == sql.status_code == 200, sql.text
    assert sql.json()["model"] == "sql" and base.json()["model"] == "tiny"
    first = [r.json()["choices"][0]["logprobs"]["token_logprobs"][0] for r in (base, sql)]
    assert abs(first[0] - first[1]) > 1e-3  # the adapter changes the distribution
    metrics = httpx.get(f"{server.base_url}/metrics").text
    (line,) = [m for m in metrics.splitlines() if m.startswith("vllm:lora_requests_info{")]
    assert 'max_lora="2"' in line and "running_lora_adapters=" in line


def test_unknown_model_is_404_in_openai_shape(server):
    response = _complete(server, "nope")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and "sql" in error["message"]


def test_runtime_load_and_unload(server, lora_setup):
    url = server.base_url + "/v1"
    load = {"lora_name": "chat", "lora_path": str(lora_setup / "chat")}
    assert httpx.post(f"{url}/load_lora_adapter", json=load).status_code == 200
    assert httpx.post(f"{url}/load_lora_adapter", json=load).status_code == 400  # twice
    assert _complete(server, "chat").status_code == 200
    big = {"lora_name": "big", "lora_path": str(lora_setup / "too-big")}
    refused = httpx.post(f"{url}/load_lora_adapter", json=big)
    assert refused.status_code == 400 and "exceeds --max-lora-rank 16" in refused.text
    assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 200
    assert _complete(server, "chat").status_code == 404
    gone = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "chat"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


def test_the_admin_port_loads_lists_and_unloads_behind_its_key(server, lora_setup):
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    load = {"lora_name": "ops", "lora_path": str(lora_setup / "chat")}
    url = f"{server.admin_url}/v1/load_lora_adapter"
    assert httpx.post(url, json=load).status_code == 401
    assert httpx.post(url, json=load, headers=admin).status_code == 200
    listed = httpx.get(f"{server.admin_url}/admin/lora-adapters", headers=admin).json()
    assert listed["enabled"] is True
    assert {"name": "ops", "path": str(lora_setup / "chat"), "base_model_name": "tiny"} in (
        listed["adapters"])
    # Served on the serving port at once, and listed by /v1/models with its parent.
    cards = {card["id"]: card for card in httpx.get(f"{server.base_url}/v1/models").json()["data"]}
    assert cards["ops"]["parent"] == "tiny"
    assert _complete(server, "ops").status_code == 200
    big = {"lora_name": "big", "lora_path": str(lora_setup / "too-big")}
    refused = httpx.post(url, json=big, headers=admin)
    assert refused.status_code == 400 and "exceeds --max-lora-rank 16" in refused.text
    missing = {"lora_name": "gone", "lora_path": str(lora_setup / "nowhere")}
    assert httpx.post(url, json=missing, headers=admin).status_code == 400
    unload = httpx.post(f"{server.admin_url}/v1/unload_lora_adapter", json={"lora_name": "ops"},
                        headers=admin)  # fmt: skip
    assert unload.status_code == 200
    assert "ops" not in {card["id"] for card in httpx.get(f"{server.base_url}/v1/models")
                         .json()["data"]}  # fmt: skip


def test_the_admin_routes_need_no_opt_in(monkeypatch, lora_setup):
    from inference.async_engine import AsyncLLMEngine
    from inference.config import EngineConfig
    from inference.server.admin import build_admin_app

    monkeypatch.delenv(RUNTIME_UPDATES_ENV, raising=False)
    engine = AsyncLLMEngine(EngineConfig.from_kwargs(str(lora_setup / "base"), device="cpu"))
    paths = set(build_admin_app(engine, "k").openapi()["paths"])
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/admin/lora-adapters"} <= paths


def _parse(args: list[str]) -> argparse.Namespace:
    return add_serve_args(argparse.ArgumentParser()).parse_args(args)


def test_lora_modules_flag_takes_both_forms(lora_setup):
    sql, chat = lora_setup / "sql", lora_setup / "chat"
    args = _parse([str(lora_setup / "base"), "--enable-lora", "--max-loras", "4",
                   "--lora-modules", f"sql={sql}",
                   f'{{"name": "chat", "path": "{chat}", "base_model_name": "tiny"}}'])
    assert args.lora_modules == [LoRAModule("sql", str(sql)), LoRAModule("chat", str(chat), "tiny")]
    assert check_serve_args(args) == []
    # A JSON list in one argument, as a pod's $(PAGODA_LORA_MODULES) expands; [] is none.
    listed = _parse([str(lora_setup / "base"), "--enable-lora", "--lora-modules",
                     f'[{{"name": "sql", "path": "{sql}"}}, {{"name": "chat", "path": "{chat}"}}]'])
    assert listed.lora_modules == [LoRAModule("sql", str(sql)), LoRAModule("chat", str(chat))]
    assert _parse(["m", "--enable-lora", "--lora-modules", "[]"]).lora_modules == []
    from inference.server.cli_serve import engine_config

    config = engine_config(args, ["tiny"])
    assert (config.enable_lora, config.max_loras) == (True, 4)
    adapters = served_adapters(args, config, ["tiny"])
    assert [r.lora_int_id for r in adapters.adapters.values()] == [1, 2]


def test_lora_modules_need_enable_lora_and_a_servable_adapter(lora_setup):
    args = _parse([str(lora_setup / "base"), "--lora-modules", f"sql={lora_setup / 'sql'}"])
    assert check_serve_args(args) == ["--lora-modules needs --enable-lora"]
    with pytest.raises(SystemExit):
        _parse(["m", "--lora-modules", "no-equals-sign"])
    args = _parse([str(lora_setup / "base"), "--enable-lora", "--lora-modules",
                   f"big={lora_setup / 'too-big'}"])
    from inference.server.cli_serve import engine_config

    with pytest.raises(ValueError, match="--lora-modules big: .*rank 32 exceeds"):
        served_adapters(args, engine_config(args, ["tiny"]), ["tiny"])


def test_runtime_routes_need_the_opt_in(monkeypatch, lora_setup):
    from inference.async_engine import AsyncLLMEngine
    from inference.config import EngineConfig
    from inference.server.app import build_app
    from inference.server.metrics import ServerMetrics

    monkeypatch.delenv(RUNTIME_UPDATES_ENV, raising=False)
    engine = AsyncLLMEngine(EngineConfig.from_kwargs(str(lora_setup / "base"), device="cpu"))
    paths = set(build_app(engine, ServerMetrics("tiny"), ["tiny"]).openapi()["paths"])
    assert "/v1/models" in paths and "/v1/load_lora_adapter" not in paths
    monkeypatch.setenv(RUNTIME_UPDATES_ENV, "True")
    paths = set(build_app(engine, ServerMetrics("tiny"), ["tiny"]).openapi()["paths"])
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= paths
