"""``pagoda serve --api-server-count 2``: two API processes accept on one port and share one
engine process; any of them answers for the whole engine (/metrics), SIGTERM drains both
before the engine stops, and one of them dying takes the server down (the pod restarts)."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import threading
import time

import httpx
from server_harness import (
    child_pids,
    free_port,
    process_alive,
    start_subprocess_server,
    wait_until_gone,
)

SUCCESS = re.compile(r'^vllm:request_success_total\{[^}]*finished_reason="length"[^}]*\} (\S+)$',
                     re.M)  # fmt: skip
START_TIME = re.compile(r"^process_start_time_seconds (\S+)$", re.M)


def _api_pids(server_pid: int, port: int) -> list[int]:
    """The other API processes: children of the server that hold its listening socket."""
    inodes = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # LISTEN
            inodes.add(f"socket:[{fields[9]}]")
    pids = []
    for pid in child_pids(server_pid):
        try:
            links = {os.readlink(fd) for fd in glob.glob(f"/proc/{pid}/fd/*")}
        except OSError:
            continue
        if links & inodes:
            pids.append(pid)
    return pids


def _engine_pid(server_pid: int, port: int) -> int:
    """The engine process: the server's spawned child that does not hold the socket."""
    fronts = set(_api_pids(server_pid, port))
    (pid,) = [pid for pid in child_pids(server_pid) if pid not in fronts
              and b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read()]  # fmt: skip
    return pid


def _metrics(base_url: str) -> str:
    # A new connection each time: the kernel hands it to either process.
    with httpx.Client(timeout=30) as client:
        return client.get(f"{base_url}/metrics").text


def _stream(base_url: str, body: dict, result: dict) -> None:
    chunks = []
    try:
        with httpx.Client(timeout=180) as client, client.stream(
            "POST", f"{base_url}/v1/completions", json={**body, "stream": True}
        ) as response:
            result["status"] = response.status_code
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    result["done"] = True
                elif line.startswith("data: "):
                    chunks.append(json.loads(line[6:]))
                    result["started"] = True
    except httpx.HTTPError as exc:
        result["error"] = repr(exc)
    result["chunks"] = chunks


def test_two_api_processes_share_the_engine_and_drain_together(tiny_model):
    proc, base_url = start_subprocess_server(
        tiny_model, "--num-kv-blocks", "64", "--api-server-count", "2",
        "--shutdown-grace-seconds", "60",
    )  # fmt: skip
    try:
        children = child_pids(proc.pid)
        # Both processes accept: their /metrics come from two process start times.
        starts: set[str] = set()
        deadline = time.monotonic() + 120
        while len(starts) < 2:
            assert time.monotonic() < deadline, f"only one API process answered: {starts}"
            starts.update(START_TIME.findall(_metrics(base_url)))
        # Greedy requests on connections of their own: the same answer whichever process
        # took them, and every one counted by each process's /metrics.
        body = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        texts: list[str] = []

        def complete() -> None:
            with httpx.Client(timeout=120) as client:
                response = client.post(f"{base_url}/v1/completions", json=body)
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])

        threads = [threading.Thread(target=complete) for _ in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)
        assert len(texts) == 12 and len(set(texts)) == 1, texts
        counted: dict[str, float] = {}
        deadline = time.monotonic() + 60
        while len(counted) < 2 or min(counted.values()) < 12:
            assert time.monotonic() < deadline, f"finished requests counted: {counted}"
            text = _metrics(base_url)
            (start,) = START_TIME.findall(text)
            counted[start] = sum(float(v) for v in SUCCESS.findall(text))
            time.sleep(0.05)
        assert set(counted.values()) == {12.0}, counted
        # SIGTERM to the first: long streams on both processes run to the end, then all exit.
        long_body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True}
        results = [{} for _ in range(6)]
        streams = [threading.Thread(target=_stream, args=(base_url, long_body, r))
                   for r in results]  # fmt: skip
        for thread in streams:
            thread.start()
        deadline = time.monotonic() + 120
        while not all(r.get("started") for r in results):
            assert time.monotonic() < deadline, results
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        for thread in streams:
            thread.join(180)
        assert proc.wait(timeout=120) == 0
        assert all(wait_until_gone(pid, 15) for pid in children), "a process outlived us"
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate(timeout=30)[0]
    for result in results:
        assert result.get("status") == 200 and result.get("done"), (result, output[-3000:])
        finish = [c["choices"][0]["finish_reason"] for c in result["chunks"] if c["choices"]]
        assert finish[-1] == "length", (result["chunks"][-1], output[-3000:])
    assert "did not stop" not in output and "still running" not in output, output[-3000:]


def test_an_api_process_dying_stops_the_server(tiny_model):
    proc, base_url = start_subprocess_server(
        tiny_model, "--num-kv-blocks", "64", "--api-server-count", "2"
    )
    try:
        children = child_pids(proc.pid)
        (front,) = _api_pids(proc.pid, int(base_url.rsplit(":", 1)[1]))
        os.kill(front, signal.SIGKILL)
        assert proc.wait(timeout=60) == 1  # Kubernetes restarts the pod
        assert all(wait_until_gone(pid, 15) for pid in children), "a process outlived us"
        assert not process_alive(front)
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate(timeout=30)[0]
    assert "exited unexpectedly" in output, output[-3000:]


def test_a_live_change_reaches_every_api_process_and_an_engine_death_stops_all(tiny_model):
    admin_port = free_port()
    proc, base_url = start_subprocess_server(
        tiny_model, "--num-kv-blocks", "64", "--max-num-seqs", "8", "--api-server-count", "2",
        "--admin-port", str(admin_port), "--admin-api-key", "admin-secret",
    )  # fmt: skip
    port = int(base_url.rsplit(":", 1)[1])
    try:
        reply = httpx.post(f"http://127.0.0.1:{admin_port}/admin/engine-config",
                           headers={"Authorization": "Bearer admin-secret"},
                           json={"max_num_seqs": 3}, timeout=60)  # fmt: skip
        assert reply.status_code == 200 and reply.json()["status"] == "applied", reply.text
        # Both processes' /metrics report the live value (the tuner reads either).
        info = re.compile(r'^pagoda:engine_config_info\{[^}]*max_num_seqs="(\d+)"', re.M)
        seen: dict[str, list[str]] = {}
        deadline = time.monotonic() + 120
        while len(seen) < 2 or any(values != ["3"] for values in seen.values()):
            assert time.monotonic() < deadline, f"engine_config_info by process: {seen}"
            text = _metrics(base_url)
            (start,) = START_TIME.findall(text)
            seen[start] = info.findall(text)
        # The engine dies: every API process fails its requests and exits; the server 1.
        children = child_pids(proc.pid)
        os.kill(_engine_pid(proc.pid, port), signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        assert all(wait_until_gone(pid, 15) for pid in children), "a process outlived us"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def test_api_server_count_flag_is_checked():
    import argparse

    from inference.server.cli_serve import add_serve_args, check_serve_args

    def errors(*argv: str) -> list[str]:
        return check_serve_args(add_serve_args(argparse.ArgumentParser()).parse_args(
            ["m", *argv]))  # fmt: skip

    assert errors("--api-server-count", "4") == []
    assert errors("--api-server-count", "0") == ["--api-server-count must be >= 1"]
    (lora,) = errors("--api-server-count", "2", "--enable-lora")
    assert "--enable-lora" in lora
