"""A real Prometheus server scrapes /metrics; PromQL over its HTTP API finds vLLM's series,
with the model_name label, holding non-zero values after traffic."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

import httpx
import pytest
from server_harness import ServerThread, free_port

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
MODEL = "tiny-prom"

# Each query must return at least one series with a value > 0. Gauges are only non-zero
# while traffic runs, so they are asked for their maximum over the run.
QUERIES = [
    "max_over_time(vllm:num_requests_running[5m])",
    "max_over_time(vllm:num_requests_waiting[5m])",
    "max_over_time(vllm:kv_cache_usage_perc[5m])",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    'vllm:request_success_total{finished_reason="length"}',
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count",
    'sum by (model_name) (vllm:time_to_first_token_seconds_bucket{le="+Inf"})',
    "histogram_quantile(0.5, sum by (le, model_name) "
    "(max_over_time(vllm:inter_token_latency_seconds_bucket[5m])))",
    "pagoda:engine_config_info",
    "vllm:cache_config_info",
    "vllm:time_per_output_token_seconds_count",
    "vllm:iteration_tokens_total_count",
    "vllm:request_prompt_tokens_count",
    "vllm:request_generation_tokens_count",
    "vllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_count",
    "vllm:request_inference_time_seconds_count",
    "process_resident_memory_bytes",
    "pagoda_engine_process_resident_memory_bytes",
]


@pytest.fixture(scope="module")
def server(tiny_model):
    # A KV cache of 16 blocks for 4 running requests that each grow to ~11 blocks: the
    # scheduler must preempt, and requests beyond max_num_seqs wait.
    server = ServerThread(
        tiny_model,
        served_model_names=[MODEL],
        num_kv_blocks=16,
        block_size=16,
        max_model_len=256,
        max_num_seqs=4,
    ).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    if not shutil.which(PROMETHEUS):
        pytest.skip("the Debian package `prometheus` is not installed (.ci/run installs it)")
    folder = tmp_path_factory.mktemp("prometheus")
    config = folder / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: pagoda\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{server.port}']\n"
    )
    proc, base_url = None, ""
    try:
        # The free port can be taken between probing and binding: try a few.
        for _ in range(3):
            proc, base_url = start_prometheus(config, folder / "data")
            try:
                wait_until(lambda url=base_url: query(url, 'up{job="pagoda"}') == [1.0], 60, proc)
                break
            except RuntimeError:
                continue
        else:
            raise RuntimeError("prometheus did not start")
        yield base_url
    finally:
        if proc is not None:
            stop_process(proc)


def start_prometheus(config, data_dir) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={data_dir}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, f"http://127.0.0.1:{port}"


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def query(base_url: str, promql: str) -> list[float]:
    try:
        response = httpx.get(f"{base_url}/api/v1/query", params={"query": promql}, timeout=5)
    except httpx.HTTPError:
        return []
    if response.status_code == 503:
        return []  # Prometheus is still opening its storage
    data = response.json()
    assert data["status"] == "success", data
    return [float(item["value"][1]) for item in data["data"]["result"]]


def series(base_url: str, promql: str) -> list[dict]:
    response = httpx.get(f"{base_url}/api/v1/query", params={"query": promql}, timeout=5)
    return response.json()["data"]["result"]


def wait_until(condition, timeout: float, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"prometheus exited: {proc.stderr.read()[-2000:]}")
        if condition():
            return
        time.sleep(0.25)
    raise AssertionError("timed out")


def traffic(base_url: str, stop: threading.Event) -> None:
    """Rounds of 8 concurrent requests sharing a prompt prefix, until told to stop."""
    prompt = "Prefix caching reuses the blocks of a shared system prompt. " * 2
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 150, "ignore_eos": True}

    def one() -> None:
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)

    while not stop.is_set():
        threads = [threading.Thread(target=one) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def test_promql_returns_vllm_series_after_traffic(server, prometheus):
    stop = threading.Event()
    load = threading.Thread(target=traffic, args=(server.base_url, stop))
    load.start()
    missing: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            missing = [q for q in QUERIES if not any(v > 0 for v in query(prometheus, q))]
            if not missing:
                break
            time.sleep(1)
    finally:
        stop.set()
        load.join()
    assert not missing, f"no non-zero series for: {missing}"
    labels = series(prometheus, "vllm:generation_tokens_total")[0]["metric"]
    assert labels["model_name"] == MODEL
    info = series(prometheus, "pagoda:engine_config_info")[0]["metric"]
    assert info["max_num_seqs"] == "4"
    assert info["num_kv_blocks"] == "16"
    assert info["block_size"] == "16"
    assert info["tensor_parallel_size"] == "1"
    assert info["gpu_memory_utilization"] == "0.9"
    cache = series(prometheus, "vllm:cache_config_info")[0]["metric"]
    assert cache["block_size"] == "16" and cache["num_gpu_blocks"] == "16"
