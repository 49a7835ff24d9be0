"""The admin API through real HTTP servers: off unless asked for, on a port of its own,
behind its own key; GET shows the live settings and what a change costs, POST applies one
between engine steps (requests streaming meanwhile get exactly their tokens) or says why
not; a change that needs CUDA graphs answers once they are captured, steps going on
meanwhile, and a second change meanwhile is refused; the settings gauges on /metrics
follow."""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerThread, engine_capturing_in_background

from inference.server.cli_serve import add_serve_args, check_serve_args

ADMIN_KEY = "admin-secret"
CLIENT_KEY = "client-secret"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
CLIENT = {"Authorization": f"Bearer {CLIENT_KEY}"}
ENGINE = {"max_model_len": 128, "block_size": 8, "num_kv_blocks": 64, "max_num_seqs": 8,
          "max_num_batched_tokens": 64}  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_model):
    thread = ServerThread(tiny_model, served_model_names=["tiny"], api_key=CLIENT_KEY,
                          admin_api_key=ADMIN_KEY, **ENGINE).start()  # fmt: skip
    yield thread
    thread.stop()


def _config_url(server) -> str:
    return f"{server.admin_url}/admin/engine-config"


def _info(server, name: str) -> list[dict[str, str]]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return [s.labels for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name]  # fmt: skip


def test_only_the_admin_key_on_the_admin_port_opens_it(server):
    url = _config_url(server)
    assert httpx.get(url, timeout=10).status_code == 401
    assert httpx.get(url, headers=CLIENT, timeout=10).status_code == 401
    assert httpx.post(url, headers=CLIENT, json={"max_num_seqs": 2}, timeout=10).status_code == 401
    served = f"{server.base_url}/admin/engine-config"
    assert httpx.get(served, headers=ADMIN, timeout=10).status_code == 404
    assert httpx.get(url, headers=ADMIN, timeout=10).status_code == 200


def test_get_shows_live_settings_and_the_cost_of_a_change(server):
    body = httpx.get(_config_url(server), headers=ADMIN, timeout=10).json()
    assert body["settings"]["max_num_batched_tokens"] == 64
    assert body["costs"]["num_kv_blocks"]["min_blocks"] == 128 // 8
    assert body["costs"]["max_num_seqs"]["capture_above"] is None  # no graphs on CPU
    plan = httpx.get(_config_url(server), params={"num_kv_blocks": 32}, headers=ADMIN,
                     timeout=10).json()["plan"]  # fmt: skip
    assert plan["kv_blocks"] == {"before": body["settings"]["num_kv_blocks"], "after": 32}
    assert plan["capture_needed"] is False and plan["preemptions"] == 0
    after = httpx.get(_config_url(server), headers=ADMIN, timeout=10).json()["settings"]
    assert after == body["settings"]  # a GET changes nothing


@pytest.mark.parametrize("change, status, words", [
    ({"max_num_seqs": 128}, 422, "must be >= max_num_seqs"),
    ({"num_kv_blocks": 3}, 422, "fewer than max_model_len"),
    ({"block_size": 16}, 422, "not a live setting"),
    ({}, 422, "non-empty JSON object"),
])  # fmt: skip
def test_a_refused_change_says_why(server, change, status, words):
    reply = httpx.post(_config_url(server), headers=ADMIN, json=change, timeout=30)
    assert reply.status_code == status
    assert words in reply.json()["error"]["message"]


def _complete(server, prompt: list[int]) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 0}  # fmt: skip
    tokens = []
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=CLIENT,
                      timeout=120) as reply:  # fmt: skip
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                tokens.extend(choice["logprobs"]["tokens"] if choice.get("logprobs") else [])
    return tokens


def test_changes_under_load_keep_every_request_whole_and_relabel_the_gauges(server):
    prompts = [[(5 * i + j) % 300 + 3 for j in range(4 + 3 * i)] for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        want = list(pool.map(lambda p: _complete(server, p), prompts))
    changes = [{"max_num_seqs": 2, "max_num_batched_tokens": 16, "num_kv_blocks": 24},
               {"max_num_seqs": 8, "max_num_batched_tokens": 64, "num_kv_blocks": 96},
               {"max_num_seqs": 3, "max_num_batched_tokens": 24, "num_kv_blocks": 16}]
    with ThreadPoolExecutor(8) as pool:
        running = [pool.submit(_complete, server, p) for p in prompts]
        for i in range(30):
            reply = httpx.post(_config_url(server), headers=ADMIN, json=changes[i % 3],
                               timeout=60)  # fmt: skip
            assert reply.status_code == 200, reply.text
            assert reply.json()["status"] == "applied"
        got = [future.result() for future in running]
    assert got == want and all(len(tokens) == 24 for tokens in got)
    final = changes[29 % 3]
    settings = httpx.get(_config_url(server), headers=ADMIN, timeout=10).json()["settings"]
    assert {k: settings[k] for k in final} == final
    engine_info = _info(server, "pagoda:engine_config_info")
    cache_info = _info(server, "vllm:cache_config_info")
    assert len(engine_info) == len(cache_info) == 1  # the old label sets are gone
    assert engine_info[0]["max_num_seqs"] == "3" and engine_info[0]["num_kv_blocks"] == "16"
    assert cache_info[0]["num_gpu_blocks"] == "16" and cache_info[0]["num_gpu_tokens"] == "128"
    server.wait_idle()
    stats = server.stats()
    assert stats.num_free_blocks == stats.num_total_blocks == 16


def test_a_change_needing_graphs_answers_once_captured_while_requests_stream(tiny_model):
    server = ServerThread(tiny_model, served_model_names=["tiny"], api_key=CLIENT_KEY,
                          admin_api_key=ADMIN_KEY, engine_factory=engine_capturing_in_background,
                          **ENGINE).start()  # fmt: skip
    try:
        url = _config_url(server)
        prompts = [[(3 * i + j) % 300 + 3 for j in range(5 + 2 * i)] for i in range(6)]
        with ThreadPoolExecutor(6) as pool:
            want = list(pool.map(lambda p: _complete(server, p), prompts))
        past_graphs = {"max_num_seqs": 16, "max_num_batched_tokens": 128}
        with ThreadPoolExecutor(8) as pool:
            first = pool.submit(httpx.post, url, headers=ADMIN, json=past_graphs, timeout=120)
            # Idle, the engine runs no steps: the capture waits (it ends only after steps).
            # A second change meanwhile is refused; one that lands first changes nothing.
            while True:
                assert not first.done(), first.result().text
                second = httpx.post(url, headers=ADMIN, json={"max_num_seqs": 8}, timeout=30)
                if second.status_code == 409:
                    break
                assert second.status_code == 200, second.text
            assert "under way" in second.json()["error"]["message"]
            settings = httpx.get(url, headers=ADMIN, timeout=10).json()["settings"]
            assert settings["max_num_seqs"] == 8  # not yet in effect
            running = [pool.submit(_complete, server, p) for p in prompts]
            reply = first.result()
            got = [future.result() for future in running]
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["status"] == "applied" and body["plan"]["background_graphs"] == 4
        assert {k: body["settings"][k] for k in past_graphs} == past_graphs
        assert body["seconds"] > 0  # the capture's time, seen by the caller
        assert got == want  # the requests that stepped through the capture are whole
    finally:
        server.stop()


def _serve_args(*argv: str) -> argparse.Namespace:
    return add_serve_args(argparse.ArgumentParser()).parse_args(["model", *argv])


def test_the_admin_api_is_off_by_default_and_needs_a_key_of_its_own(monkeypatch):
    monkeypatch.delenv("PAGODA_ADMIN_API_KEY", raising=False)
    assert _serve_args().admin_port is None
    assert check_serve_args(_serve_args()) == []
    assert any("needs --admin-api-key" in e for e in check_serve_args(_serve_args(
        "--admin-port", "9000")))  # fmt: skip
    same = _serve_args("--admin-port", "9000", "--admin-api-key", "k", "--api-key", "k")
    assert any("must differ from --api-key" in e for e in check_serve_args(same))
    assert check_serve_args(_serve_args("--admin-port", "9000", "--admin-api-key", "k")) == []
