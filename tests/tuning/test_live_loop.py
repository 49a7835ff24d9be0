"""The tuner's live loop against a real engine: a tuner window decides a maxNumSeqs raise,
makes it through the engine server's real admin API (HTTP, the key from the admin Secret),
the engine's `pagoda:engine_config_info` shows it without a restart, and the next windows
judge it on those labels and keep it. The Kubernetes side is the recording client of
test_tuner_parts (the kmock runs are tests/k8s/test_operator_kmock.py and
tests/tuning/test_tuner_live.py)."""

from __future__ import annotations

import base64
import copy

import httpx
import pytest
from pagoda_operator.live_settings import ADMIN_PORT, ADMIN_SECRET_KEY
from pagoda_operator.tuning.live import post_change
from pagoda_operator.tuning.policy import MAX_NUM_SEQS
from pagoda_operator.tuning.prometheus import Observation
from prometheus_client.parser import text_string_to_metric_families
from server.server_harness import ServerThread
from tiny_models import build_tiny_model

from .policy_cases import QUEUED_WITH_FREE_KV
from .test_tuner_parts import engine_pod, run_window

ADMIN_KEY = "the-admin-key-of-m"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-live-loop")
    build_tiny_model(folder, "llama")
    # The spec's maxNumSeqs (64) and gpuMemoryUtilization (0.9), as the pod would start.
    server = ServerThread(str(folder), served_model_names=["m"], admin_api_key=ADMIN_KEY,
                          max_num_seqs=64, max_num_batched_tokens=256, max_model_len=128,
                          num_kv_blocks=64).start()  # fmt: skip
    yield server
    server.stop()


def config_labels(server: ServerThread) -> dict[str, str]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    (labels,) = [s.labels for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "pagoda:engine_config_info"]  # fmt: skip
    return labels


def test_a_tuner_window_changes_a_running_engine_and_judges_it(engine: ServerThread) -> None:
    port = int(engine.admin_url.rsplit(":", 1)[1])

    async def to_the_engine(url: str, key: str, body: dict):
        # The pods' address and admin port, as the operator builds it, is this server's.
        assert f":{ADMIN_PORT}/admin/engine-config" in url
        return await post_change(url.replace(f":{ADMIN_PORT}/", f":{port}/"), key, body)

    secret = {"data": {ADMIN_SECRET_KEY: base64.b64encode(ADMIN_KEY.encode()).decode()}}
    wiring = {"pods": [engine_pod("m-a", "127.0.0.1"), engine_pod("m-b", "127.0.0.1")],
              "post_change": to_the_engine, "secrets": {"m-engine-admin": secret}}  # fmt: skip
    pid = engine.engine.engine_pid
    queued = Observation(QUEUED_WITH_FREE_KV)
    _, api, _, _ = run_window("Auto", queued, now=0, **wiring)
    _, api, events, _ = run_window("Auto", queued, copy.deepcopy(api.llmd["status"]), now=60,
                                   **wiring)  # fmt: skip
    assert events[-1][1] == "TuningAppliedLive", events
    assert api.llmd["status"]["tuning"]["overrides"][MAX_NUM_SEQS]["live"] is True
    labels = config_labels(engine)
    assert labels["max_num_seqs"] == "128" and engine.engine.engine_pid == pid  # no restart
    # Judged on the engines' own labels once a full window has passed, and kept.
    counts = {"replicas": 2, "updatedReplicas": 2, "readyReplicas": 2}
    live = Observation(QUEUED_WITH_FREE_KV, live=[labels, labels])
    status = {**copy.deepcopy(api.llmd["status"]), **counts}
    for now in (120, 180):
        judged, api, events, _ = run_window("Auto", live, status, now=now, **wiring)
        status = {**copy.deepcopy(api.llmd["status"]), **counts}
    assert judged["decisions"][-1]["outcome"].startswith("kept"), judged["decisions"][-1]
    assert ("Normal", "TuningKept") in [e[:2] for e in events]
    reply = httpx.get(engine.admin_url + "/admin/engine-config", timeout=10,
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"})  # fmt: skip
    assert reply.json()["settings"]["max_num_seqs"] == 128
