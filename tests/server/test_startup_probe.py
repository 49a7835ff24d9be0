"""The probes the operator wires up: while the model loads, /health (liveness) answers 200
and /ready (startup and readiness) answers 503, so the startup probe fails until the model is
loaded and a load that hangs past startupTimeoutSeconds gets the pod restarted."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
from server_harness import ServerThread, wait_ready

GATE_ENV = "PAGODA_TEST_LOAD_GATE"


def engine_loading_until_gate_opens(config):
    """Runs in the engine process: the model load does not finish until the gate file exists."""
    from inference.engine_core import default_engine_factory

    gate = Path(os.environ[GATE_ENV])
    deadline = time.monotonic() + 300
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return default_engine_factory(config)


def test_ready_fails_while_loading_and_health_does_not(tiny_model, tmp_path, monkeypatch):
    gate = tmp_path / "loaded"
    monkeypatch.setenv(GATE_ENV, str(gate))
    server = ServerThread(
        tiny_model, engine_factory=engine_loading_until_gate_opens, num_kv_blocks=32, max_num_seqs=2
    )
    server._thread.start()
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                health = httpx.get(f"{server.base_url}/health", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the server never answered"
                time.sleep(0.1)
        assert health.status_code == 200
        ready = httpx.get(f"{server.base_url}/ready", timeout=5)
        assert ready.status_code == 503 and ready.json()["status"] == "loading"
        gate.touch()
        wait_ready(server.base_url, engine=server.engine)
        assert httpx.get(f"{server.base_url}/ready", timeout=5).status_code == 200
    finally:
        gate.touch()
        server.stop()
