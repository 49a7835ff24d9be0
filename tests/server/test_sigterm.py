"""SIGTERM: keep accepting connections while draining (new requests get 503 with
Retry-After), finish in-flight requests within the grace period, then answer what is left
with an OpenAI-shaped error, and exit 0. A port in use fails at once."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
from server_harness import (
    ROOT,
    child_pids,
    start_subprocess_server,
    wait_until_gone,
)
from tiny_models import build_tiny_model


def stream_completion(base_url: str, body: dict, result: dict, first_chunk: threading.Event):
    chunks = []
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as r:
            result["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
                    first_chunk.set()
                elif line == "data: [DONE]":
                    result["done"] = True
    except httpx.HTTPError as exc:
        result["error"] = repr(exc)
    finally:
        first_chunk.set()
    result["chunks"] = chunks


def wait_for_requests_in_engine(base_url: str, count: int, timeout: float = 60) -> None:
    pattern = re.compile(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.e+]+)$", re.M)
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
        if sum(float(v) for v in pattern.findall(text)) >= count:
            return
        assert time.monotonic() < deadline, f"fewer than {count} requests reached the engine"
        time.sleep(0.05)


def test_sigterm_drains_in_flight_requests_and_exits_0(tiny_model):
    proc, base_url = start_subprocess_server(
        tiny_model, "--num-kv-blocks", "64", "--shutdown-grace-seconds", "60"
    )
    try:
        body = {"prompt": "The quick brown fox", "max_tokens": 400, "ignore_eos": True,
                "stream": True}  # fmt: skip
        result: dict = {}
        first_chunk = threading.Event()
        client = threading.Thread(
            target=stream_completion, args=(base_url, body, result, first_chunk)
        )
        client.start()
        assert first_chunk.wait(60)
        children = child_pids(proc.pid)  # the engine process (and multiprocessing's tracker)
        assert children
        proc.send_signal(signal.SIGTERM)
        # Draining: new connections are still accepted; new requests get 503 + Retry-After
        # (and /ready 503, so the pod leaves its Service) while the stream continues.
        deadline = time.monotonic() + 10
        while httpx.get(f"{base_url}/ready", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "/ready still 200 after SIGTERM"
            time.sleep(0.02)
        assert client.is_alive(), "the stream must still be running for this test to mean much"
        late = httpx.post(f"{base_url}/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert late.status_code == 503, late.text
        assert int(late.headers["retry-after"]) >= 1
        assert late.json()["error"]["type"] == "service_unavailable_error"
        assert httpx.get(f"{base_url}/health", timeout=5).status_code == 200
        client.join(timeout=120)
        assert proc.wait(timeout=60) == 0
        assert all(wait_until_gone(pid, 5) for pid in children), "an engine process outlived us"
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate(timeout=10)[0]
    assert result.get("status") == 200, (result, output)
    assert result.get("done"), (result, output)
    finish = [c["choices"][0]["finish_reason"] for c in result["chunks"] if c["choices"]]
    assert finish[-1] == "length", "the in-flight request ran to completion"
    assert "Finished server process" in output
    assert "did not stop" not in output, "the engine process had to be killed"


def test_sigterm_grace_period_bounds_the_wait(tmp_path):
    # A request of 6,000 tokens takes seconds even for a tiny model on a fast machine: far
    # longer than the 1 s grace period.
    build_tiny_model(tmp_path, "llama", max_position_embeddings=8192)
    proc, base_url = start_subprocess_server(
        str(tmp_path), "--num-kv-blocks", "600", "--max-model-len", "8192",
        "--shutdown-grace-seconds", "1",
    )  # fmt: skip
    try:
        body = {"prompt": "hi", "max_tokens": 6000, "ignore_eos": True}
        result: dict = {}
        first_chunk = threading.Event()
        client = threading.Thread(
            target=stream_completion, args=(base_url, {**body, "stream": True}, result,
                                            first_chunk),
        )  # fmt: skip
        client.start()
        plain: dict = {}
        waiter = threading.Thread(
            target=lambda: plain.update(
                response=httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
            )
        )
        waiter.start()
        assert first_chunk.wait(60)
        # Both requests must be in the engine before the signal: a request that arrives
        # once draining has begun gets the "not ready" 503 instead (a different case).
        wait_for_requests_in_engine(base_url, 2)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert time.monotonic() - started < 30
        client.join(timeout=30)
        waiter.join(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate(timeout=10)[0]
    # 6,000 tokens cannot finish within a 1 s grace period: the stream ends with an error
    # event and [DONE], the plain request with an OpenAI-shaped 503.
    assert result.get("status") == 200 and result.get("done"), (result, output)
    error = result["chunks"][-1]["error"]
    assert "--shutdown-grace-seconds" in error["message"], error
    response = plain["response"]
    assert response.status_code == 503, response.text
    assert "--shutdown-grace-seconds" in response.json()["error"]["message"]


def test_port_in_use_fails_before_loading_the_model(tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [
            sys.executable, "-m", "inference.server.cli_serve", tiny_model,
            "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
        ]  # fmt: skip
        started = time.monotonic()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr
    assert "in use" in done.stderr
    assert "ready" not in done.stdout, "it must not load the model first"
    assert time.monotonic() - started < 60


def test_engine_process_exits_when_the_server_is_killed(tiny_model):
    proc, _ = start_subprocess_server(tiny_model, "--num-kv-blocks", "64")
    try:
        children = child_pids(proc.pid)
        assert children
        proc.kill()  # no shutdown: the engine process must notice its parent is gone
        proc.wait(timeout=10)
        assert all(wait_until_gone(pid, 15) for pid in children), "orphaned engine process"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def test_a_second_sigterm_stops_now_and_says_so(tmp_path):
    build_tiny_model(tmp_path, "llama", max_position_embeddings=8192)
    proc, base_url = start_subprocess_server(
        str(tmp_path), "--num-kv-blocks", "600", "--max-model-len", "8192",
        "--shutdown-grace-seconds", "120",
    )  # fmt: skip
    try:
        body = {"prompt": "hi", "max_tokens": 6000, "ignore_eos": True, "stream": True}
        result: dict = {}
        first_chunk = threading.Event()
        client = threading.Thread(target=stream_completion,
                                  args=(base_url, body, result, first_chunk))
        client.start()
        assert first_chunk.wait(60)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # draining: the request runs on
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert time.monotonic() - started < 30, "the second signal did not stop it at once"
        client.join(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate(timeout=10)[0]
    assert "second signal: stopping now" in output
    assert "grace period (0 s)" not in output
    error = result["chunks"][-1]["error"]
    assert "second shutdown signal" in error["message"], error
