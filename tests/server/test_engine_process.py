"""The engine runs in its own process: when it dies or fails, /health says so and in-flight
requests end with an error at once (never hang); shutting the server down leaves no engine
process behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import httpx
from server_harness import (
    FAULT_SEED,
    ServerThread,
    child_pids,
    engine_failing_on_fault_seed,
    start_subprocess_server,
    wait_until_gone,
)

from benchmarks import serve_trace
from inference.bench import serve as bench_serve

LONG = {"prompt": "The quick brown fox", "max_tokens": 200, "ignore_eos": True}


def stream_events(base_url: str, body: dict, events: list, first: threading.Event) -> None:
    """Collect a streamed completion's SSE payloads (dicts, or "[DONE]")."""
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    events.append(data if data == "[DONE]" else json.loads(data))
                    first.set()
    finally:
        first.set()


def start_stream(base_url: str, body: dict) -> tuple[threading.Thread, list, threading.Event]:
    events: list = []
    first = threading.Event()
    thread = threading.Thread(target=stream_events, args=(base_url, body, events, first))
    thread.start()
    assert first.wait(60), "no first chunk"
    return thread, events, first


def assert_dead_server(base_url: str, reason_part: str) -> None:
    health = httpx.get(f"{base_url}/health", timeout=5)
    assert health.status_code == 503
    assert reason_part in health.json()["reason"]
    assert httpx.get(f"{base_url}/ready", timeout=5).status_code == 503
    late = httpx.post(f"{base_url}/v1/completions", json={"prompt": "hi"}, timeout=10)
    assert late.status_code == 503, late.text


def test_engine_failure_errors_in_flight_requests_and_fails_health(tiny_model):
    server = ServerThread(
        tiny_model, engine_factory=engine_failing_on_fault_seed, num_kv_blocks=64, max_num_seqs=4
    ).start()
    try:
        pid = server.engine.engine_pid
        base_url = server.base_url
        assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}
        # A non-streamed request in flight when the engine fails...
        waiting: dict = {}
        plain = threading.Thread(
            target=lambda: waiting.update(
                response=httpx.post(f"{base_url}/v1/completions", json=LONG, timeout=60)
            )
        )
        plain.start()
        # ...and a stream that brings the fault a few steps after its first chunk.
        started = time.monotonic()
        thread, events, _ = start_stream(base_url, {**LONG, "stream": True, "seed": FAULT_SEED})
        thread.join(30)
        plain.join(30)
        assert not thread.is_alive() and not plain.is_alive(), "a request hung"
        assert time.monotonic() - started < 20
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert errors and "injected fault" in errors[0]["error"]["message"], events
        assert events[-1] == "[DONE]"
        assert waiting["response"].status_code == 503, waiting["response"].text
        assert_dead_server(base_url, "injected fault")
    finally:
        server.stop()
    assert wait_until_gone(pid, 10), "the failed engine process outlived the server"


def test_engine_process_killed_mid_stream(tiny_model):
    server = ServerThread(tiny_model, num_kv_blocks=64, max_num_seqs=4).start()
    try:
        pid = server.engine.engine_pid
        thread, events, _ = start_stream(server.base_url, {**LONG, "stream": True})
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        thread.join(10)
        assert not thread.is_alive(), "the stream hung after the engine process died"
        assert time.monotonic() - killed < 5
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert errors and "exited unexpectedly" in errors[0]["error"]["message"], events
        assert events[-1] == "[DONE]"
        assert_dead_server(server.base_url, "exited unexpectedly")
    finally:
        server.stop()


def test_hung_engine_fails_health_and_requests(tiny_model):
    """SIGSTOP of the engine process: neither dead nor answering. After the step timeout
    /health is 503, in-flight requests end with an error, and the engine is killed."""
    server = ServerThread(
        tiny_model, num_kv_blocks=64, max_num_seqs=4, engine_step_timeout_s=3.0
    ).start()
    try:
        pid = server.engine.engine_pid
        base_url = server.base_url
        # 480 tokens: still running when the engine stops, even on a fast machine.
        long = {**LONG, "max_tokens": 480}
        thread, events, _ = start_stream(base_url, {**long, "stream": True})
        waiting: dict = {}
        plain = threading.Thread(
            target=lambda: waiting.update(
                response=httpx.post(f"{base_url}/v1/completions", json=long, timeout=60)
            )
        )
        plain.start()
        time.sleep(0.2)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        while httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
            assert time.monotonic() - stopped < 20, "/health stayed 200 with a stopped engine"
            time.sleep(0.1)
        detected = time.monotonic() - stopped
        assert 1.0 < detected < 20, detected  # the watchdog waits out its timeout (3 s)
        thread.join(20)
        plain.join(20)
        assert not thread.is_alive() and not plain.is_alive(), "a request hung"
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert errors and "--engine-step-timeout" in errors[0]["error"]["message"], events
        assert events[-1] == "[DONE]"
        assert waiting["response"].status_code == 503, waiting["response"].text
        assert "hung" in waiting["response"].json()["error"]["message"]
        assert_dead_server(base_url, "hung")
        assert wait_until_gone(pid, 10), "the hung engine process was not killed"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        server.stop()


def test_server_exits_nonzero_when_the_engine_is_killed(tiny_model):
    """kill -9 of the engine: `pagoda serve` exits 1 at once, so Kubernetes restarts it."""
    proc, base_url = start_subprocess_server(tiny_model, "--num-kv-blocks", "64")
    try:
        engine_pids = [pid for pid in child_pids(proc.pid) if "spawn_main" in _cmdline(pid)]
        assert len(engine_pids) == 1, child_pids(proc.pid)
        thread, events, _ = start_stream(base_url, {**LONG, "stream": True})
        killed = time.monotonic()
        os.kill(engine_pids[0], signal.SIGKILL)
        code = proc.wait(timeout=30)
        elapsed = time.monotonic() - killed
        thread.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate(timeout=10)[0]
    assert code == 1, output
    assert elapsed < 10, elapsed
    assert events[-1] == "[DONE]" and any("error" in e for e in events if isinstance(e, dict))
    assert "exited unexpectedly" in output


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_step_trace_records_every_step(tiny_model, tmp_path, monkeypatch, capsys):
    """PAGODA_STEP_TRACE: the engine process writes one CSV row per step when it stops."""
    trace = tmp_path / "steps.csv"
    monkeypatch.setenv("PAGODA_STEP_TRACE", str(trace))
    server = ServerThread(tiny_model, num_kv_blocks=64, max_num_seqs=4).start()
    try:
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "ignore_eos": True}
        assert httpx.post(f"{server.base_url}/v1/completions", json=body).status_code == 200
        bench_args = [
            "--base-url", server.base_url, "--num-prompts", "4", "--input-len", "8",
            "--output-len", "4", "--token-ids", "--vocab-size", "300", "--save-detailed",
            "--output-json", str(tmp_path / "bench.json"),
        ]  # fmt: skip
        assert bench_serve.main(bench_args) == 0
    finally:
        server.stop()
    pid = server.engine.engine_pid
    assert wait_until_gone(pid, 10)
    header, *rows = trace.read_text().splitlines()
    assert header.split(",")[:3] == ["start_s", "step_ms", "send_ms"]
    columns = list(zip(*(map(float, row.split(",")) for row in rows), strict=True))
    # The first request's tokens, then the bench's warm-up (8 + 4) and its 4 x (8 + 4).
    assert sum(columns[5]) == 4 + 5 * 8 and sum(columns[6]) == 6 + 5 * 4
    assert all(ms >= 0 for ms in columns[1])
    assert header.split(",")[7:] == ["cpu_ms", "preempted", "device_wait_ms"]
    assert all(0 <= wait <= step + 1e-3 for wait, step in zip(columns[9], columns[1], strict=True))
    assert all(ms >= 0 for ms in columns[7]) and sum(columns[7]) > 0
    assert serve_trace.main([str(tmp_path / "bench.json"), str(trace)]) == 0
    out = capsys.readouterr().out
    assert "engine steps during the run" in out and "engine loop thread: CPU" in out
