"""A client that goes away aborts its request and gives its KV blocks back."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest


def raw_post(base_url: str, path: str, body: dict) -> socket.socket:
    """Send a request on a bare socket, so the test decides exactly when it hangs up."""
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock.sendall(head + payload)
    return sock


def read_until(sock: socket.socket, marker: bytes, count: int) -> bytes:
    data = b""
    while data.count(marker) < count:
        chunk = sock.recv(4096)
        assert chunk, f"server closed early: {data!r}"
        data += chunk
    return data


def aborted_total(base_url: str) -> float:
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no abort counter")


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


@pytest.fixture
def idle_server(tiny_server):
    tiny_server.wait_idle()
    start = tiny_server.engine.stats
    assert start.num_free_blocks == start.num_total_blocks
    return tiny_server


LONG = {"prompt": "The quick brown fox", "max_tokens": 200, "ignore_eos": True}


def test_disconnect_mid_stream_frees_blocks(idle_server):
    server = idle_server
    free_at_start = server.engine.stats.num_free_blocks
    aborts_before = aborted_total(server.base_url)
    sock = raw_post(server.base_url, "/v1/completions", {**LONG, "stream": True})
    read_until(sock, b"data:", 3)
    # Blocks are in use while the request runs...
    assert server.engine.stats.num_free_blocks < free_at_start
    sock.close()
    # ...and all come back once the server notices the client is gone.
    wait_for(lambda: server.engine.num_in_flight == 0)
    server.wait_idle()
    assert server.engine.stats.num_free_blocks == free_at_start
    wait_for(lambda: aborted_total(server.base_url) == aborts_before + 1)


def test_disconnect_while_waiting_for_non_streamed_answer(idle_server):
    server = idle_server
    free_at_start = server.engine.stats.num_free_blocks
    sock = raw_post(server.base_url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 200, "ignore_eos": True,
    })  # fmt: skip
    wait_for(lambda: server.engine.stats.num_free_blocks < free_at_start)
    sock.close()
    wait_for(lambda: server.engine.num_in_flight == 0)
    server.wait_idle()
    assert server.engine.stats.num_free_blocks == free_at_start


def test_many_clients_vanish_at_once(idle_server):
    server = idle_server
    free_at_start = server.engine.stats.num_free_blocks
    socks = [
        raw_post(server.base_url, "/v1/completions", {**LONG, "stream": True, "n": 2})
        for _ in range(6)
    ]
    read_until(socks[0], b"data:", 2)
    for sock in socks:
        sock.close()
    wait_for(lambda: server.engine.num_in_flight == 0)
    server.wait_idle()
    assert server.engine.stats.num_free_blocks == free_at_start
    # And the server still answers.
    body = {"prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{server.base_url}/v1/completions", json=body).status_code == 200
