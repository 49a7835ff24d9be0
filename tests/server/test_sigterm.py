"""SIGTERM: stop accepting, finish in-flight requests within the grace period, exit 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
from server_harness import child_pids, start_subprocess_server, wait_until_gone
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


def test_sigterm_drains_in_flight_requests_and_exits_0(tiny_model):
    proc, base_url = start_subprocess_server(
        tiny_model, "--num-kv-blocks", "64", "--shutdown-grace-seconds", "60"
    )
    try:
        body = {"prompt": "The quick brown fox", "max_tokens": 120, "ignore_eos": True,
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
        # Draining: new connections are refused while the in-flight stream continues.
        refused = False
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not refused:
            try:
                httpx.get(f"{base_url}/health", timeout=2)
                time.sleep(0.05)
            except httpx.HTTPError:
                refused = True
        assert refused, "the server kept accepting connections after SIGTERM"
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
        body = {"prompt": "hi", "max_tokens": 6000, "ignore_eos": True, "stream": True}
        result: dict = {}
        first_chunk = threading.Event()
        client = threading.Thread(
            target=stream_completion, args=(base_url, body, result, first_chunk)
        )
        client.start()
        assert first_chunk.wait(60)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert time.monotonic() - started < 30
        client.join(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)
    assert not result.get("done"), "6,000 tokens cannot finish within a 1 s grace period"


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
