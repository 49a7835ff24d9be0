"""The tuner's PromQL against a real Prometheus, for the names Kubernetes objects really have:
hyphenated (almost all of them), dotted, and 63 characters long (whose pod names the API
server cuts to 58 characters before the random suffix).

A small exporter serves, for each LLMDeployment, the engine series with the labels the
relabelling in operator/README.md gives them and the kube-state-metrics series of its pods
(honor_labels keeps both as served). Next to each target sits a decoy whose name differs only
where a wrong escape would let it match (a suffix, or a character where the target has a
dot); its pods restart ten times as fast, so counting them shows up in the restarts.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from k8s.emulated_cluster import wait_for
from k8s.test_autoscalers import adapter_queries
from pagoda_operator.autoscalers import autoscaler_queries
from pagoda_operator.tuning.prometheus import PrometheusEndpoint, observe, snapshot_queries
from prometheus_process import running_prometheus

NAMESPACE = "team-a"
LONG_NAME = "llama-3-1-70b-instruct-fp8-dynamic-with-a-rather-long-suffix-x1"
TARGETS = ("qwen2-5-7b", "qwen2.5-7b", LONG_NAME)
DECOYS = ("qwen2-5-7b-canary", "qwen2x5-7b", LONG_NAME[:-1] + "z")
TEMPLATE_HASH = "7d4b9c8f5d"
WINDOW_S = 6.0
TARGET_RESTARTS_PER_S, DECOY_RESTARTS_PER_S = 1.0, 10.0

pytestmark = pytest.mark.slow


def pod_name(name: str, index: int) -> str:
    """As the API server names a ReplicaSet's pods: generateName cut to 58 characters, then
    five random characters (the decoys' differ, as random ones would)."""
    suffix = "q7w3" if name in DECOYS else "x2k9"
    return f"{name}-{TEMPLATE_HASH}-"[:58] + f"{suffix}{index}"


def exposition(started: float) -> str:
    elapsed = time.monotonic() - started
    lines = []
    for name, restart_rate in [(n, TARGET_RESTARTS_PER_S) for n in TARGETS] + [
        (n, DECOY_RESTARTS_PER_S) for n in DECOYS
    ]:
        for index in range(2):
            pod = pod_name(name, index)
            engine = f'namespace="{NAMESPACE}",llmdeployment="{name}",pod="{pod}"'
            ksm = f'namespace="{NAMESPACE}",pod="{pod}"'
            lines += [
                f"vllm:num_requests_running{{{engine}}} 3",
                f"vllm:num_requests_waiting{{{engine}}} 2",
                f"vllm:kv_cache_usage_perc{{{engine}}} 0.5",
                f"vllm:num_preemptions_total{{{engine}}} 0",
                f"vllm:generation_tokens_total{{{engine}}} {elapsed * 100:.3f}",
                f"vllm:prompt_tokens_total{{{engine}}} {elapsed * 300:.3f}",
                f'vllm:request_success_total{{{engine},finished_reason="length"}} {elapsed:.3f}',
                f'vllm:request_success_total{{{engine},finished_reason="abort"}} 0',
                f'pagoda:engine_config_info{{{engine},max_num_seqs="8"}} 1',
            ]
            for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
                for le in ("0.1", "1.0", "+Inf"):
                    count = elapsed * (0.5 if le == "0.1" else 1.0)
                    lines.append(f'vllm:{histogram}_bucket{{{engine},le="{le}"}} {count:.3f}')
            lines += [
                f'kube_pod_owner{{{ksm},owner_kind="ReplicaSet",'
                f'owner_name="{name}-{TEMPLATE_HASH}",owner_is_controller="true"}} 1',
                f'kube_pod_container_status_restarts_total{{{ksm},container="engine"}} '
                f"{int(elapsed * restart_rate)}",
                f"kube_pod_container_status_last_terminated_reason"
                f'{{{ksm},container="engine",reason="OOMKilled"}} {1 if index == 0 else 0}',
            ]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def exporter() -> Iterator[str]:
    started = time.monotonic()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = exposition(started).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def prometheus(exporter: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    jobs = (
        "  - job_name: engines-and-ksm\n    honor_labels: true\n"
        f"    static_configs:\n      - targets: ['{exporter}']\n"
    )
    with running_prometheus(tmp_path_factory.mktemp("prometheus"), jobs) as url:
        # Rates need samples spanning most of the window.
        wait_for(lambda: scraped_for(url) >= WINDOW_S + 2, timeout=90, what="a window of samples")
        yield url


def scraped_for(url: str) -> float:
    """Seconds of samples Prometheus holds for the exporter (0 while it has none)."""
    query = "time() - min_over_time(timestamp(up)[1m:1s])"
    try:
        result = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=2).json()
        return float(result["data"]["result"][0]["value"][1])
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return 0.0


@pytest.mark.parametrize("name", TARGETS, ids=["hyphenated", "dotted", "long"])
def test_every_query_is_valid_promql_and_selects_only_its_own_series(
    prometheus: str, name: str
) -> None:
    observation = asyncio.run(observe(PrometheusEndpoint(prometheus), NAMESPACE, name, WINDOW_S))
    assert observation.problem == "", observation.problem
    snapshot = observation.snapshot
    assert snapshot is not None
    assert snapshot.pods == 2  # not the decoy's two as well
    assert snapshot.requests_waiting == pytest.approx(4)
    assert snapshot.kv_cache_usage == pytest.approx(0.5)
    assert snapshot.ttft_p95_s is not None and 0.1 < snapshot.ttft_p95_s <= 1.0
    assert len(observation.live) == 2
    # Restarts of this LLMDeployment's pods alone: a decoy's would add ten times as many.
    assert snapshot.restarts is not None
    expected = 2 * TARGET_RESTARTS_PER_S * WINDOW_S
    assert 0.3 * expected < snapshot.restarts < 3 * expected
    # One of its two pods was last terminated by an OOM kill while it restarts.
    assert snapshot.oom_kills is not None and 0 < snapshot.oom_kills < 3 * expected / 2


def test_each_query_parses_for_every_name(prometheus: str) -> None:
    """Every query of the snapshot, for names with each character a name may hold, is
    accepted by Prometheus's own parser (an error here is HTTP 400 in every window)."""
    for name in (*TARGETS, "a", "a.b-c.d-e"):
        for key, promql in snapshot_queries("ns-1.x", name, WINDOW_S).items():
            response = httpx.get(f"{prometheus}/api/v1/query", params={"query": promql}, timeout=10)
            assert response.status_code == 200, (name, key, response.text)


def instant(prometheus: str, promql: str) -> list[dict]:
    response = httpx.get(f"{prometheus}/api/v1/query", params={"query": promql}, timeout=10)
    assert response.status_code == 200, (promql, response.text)
    return response.json()["data"]["result"]


@pytest.mark.parametrize("name", [TARGETS[0], TARGETS[2]], ids=["hyphenated", "long"])
def test_autoscaler_queries_sum_only_their_own_engines(prometheus: str, name: str) -> None:
    """KEDA's trigger queries (summed, KEDA divides by replicas) and the shipped
    prometheus-adapter rules (per pod, as the HPA asks for them) against the real thing.
    (No dotted name here: the CRD allows none, and prometheus-adapter puts pod names into a
    regex unescaped.)"""
    keda = autoscaler_queries(NAMESPACE, name)
    (waiting,) = instant(prometheus, keda["requests-waiting"])
    assert float(waiting["value"][1]) == pytest.approx(4)  # 2 engines x 2, no decoy
    (kv,) = instant(prometheus, keda["kv-cache-usage"])
    assert float(kv["value"][1]) == pytest.approx(1.0)
    pods = [pod_name(name, index) for index in range(2)]
    for metric, query in adapter_queries(NAMESPACE, pods).items():
        result = instant(prometheus, query)
        assert sorted(item["metric"]["pod"] for item in result) == sorted(pods), metric
        expected = 2.0 if metric == "vllm_num_requests_waiting" else 0.5
        assert all(float(item["value"][1]) == pytest.approx(expected) for item in result)
