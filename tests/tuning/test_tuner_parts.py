"""The tuner around the policy: spec -> limits, PromQL answers -> Snapshot, status and Events,
and one whole window of the runner against a recording client."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pagoda_operator.spec import with_defaults
from pagoda_operator.status import workload_status
from pagoda_operator.tuning import runner
from pagoda_operator.tuning.knobs import (
    current_settings,
    limits_from_spec,
    rollout_complete,
    spec_patch,
)
from pagoda_operator.tuning.policy import GPU_MEMORY_UTILIZATION, MAX_NUM_SEQS, REPLICAS
from pagoda_operator.tuning.prometheus import (
    Observation,
    snapshot_from_results,
    snapshot_queries,
)
from pagoda_operator.tuning.record import METRICS_AVAILABLE

from .policy_cases import QUEUED_WITH_FREE_KV


def spec(**tuning: Any) -> dict[str, Any]:
    return with_defaults(
        {
            "model": {"name": "m"},
            "replicas": 2,
            "engine": {"maxNumSeqs": 64},
            "autoscaling": {"minReplicas": 1, "maxReplicas": 4},
            "tuning": {"mode": "Auto", "cooldownSeconds": 120, **tuning},
            "prometheus": {"url": "http://prometheus:9090"},
        }
    )


def test_limits_follow_bounds_pins_autoscaling_and_slo() -> None:
    limits = limits_from_spec(
        spec(
            bounds={"maxNumSeqs": {"min": 16, "max": 512}, "gpuMemoryUtilization": {"max": 0.92}},
            pinned=["gpuMemoryUtilization"],
            slo={"ttftP95Seconds": 0.5, "itlP95Seconds": 0.05},
        )
    )
    assert limits.bounds == {REPLICAS: (1, 4), MAX_NUM_SEQS: (16, 512)}
    assert GPU_MEMORY_UTILIZATION in limits.fixed
    assert (limits.cooldown_s, limits.ttft_target_s, limits.itl_target_s) == (120, 0.5, 0.05)

    hpa = spec()
    hpa["autoscaling"]["enabled"] = True
    assert "HorizontalPodAutoscaler" in limits_from_spec(hpa).fixed[REPLICAS]
    single = spec()
    single["autoscaling"]["maxReplicas"] = 1
    assert REPLICAS in limits_from_spec(single).fixed
    assert current_settings(spec()) == {REPLICAS: 2, MAX_NUM_SEQS: 64, GPU_MEMORY_UTILIZATION: 0.9}


def test_spec_patch_sets_one_field() -> None:
    assert spec_patch(REPLICAS, 3) == {"replicas": 3}
    assert spec_patch(MAX_NUM_SEQS, 128.0) == {"engine": {"maxNumSeqs": 128}}
    assert spec_patch(GPU_MEMORY_UTILIZATION, 0.92) == {"engine": {"gpuMemoryUtilization": 0.92}}


def test_rollout_is_complete_when_every_engine_runs_the_spec() -> None:
    settings = current_settings(spec())
    ready = {"replicas": 2, "updatedReplicas": 2, "readyReplicas": 2}
    live = [{"max_num_seqs": "64", "gpu_memory_utilization": "0.9"}] * 2
    assert rollout_complete(ready, settings, live)
    assert not rollout_complete({**ready, "readyReplicas": 1}, settings, live)
    assert not rollout_complete({**ready, "replicas": 3}, settings, live)  # old pod draining
    assert not rollout_complete(ready, settings, live[:1])
    stale = [live[0], {"max_num_seqs": "32", "gpu_memory_utilization": "0.9"}]
    assert not rollout_complete(ready, settings, stale)


def vector(value: str) -> list[dict[str, Any]]:
    return [{"metric": {}, "value": [0, value]}]


def answers(**overrides: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    results = {key: vector("1") for key in snapshot_queries("ns", "m", 60)}
    results["pods"] = vector("2")
    results.update(overrides)
    return results


def test_queries_select_the_deployment_and_its_pods() -> None:
    queries = snapshot_queries("team-a", "qwen", 30)
    assert 'namespace="team-a",llmdeployment="qwen"' in queries["kv_cache_usage"]
    assert "[30s]" in queries["preemptions_per_s"]
    assert queries["ttft_p95_s"].startswith("histogram_quantile(0.95, sum by (le)")
    assert "vllm:time_to_first_token_seconds_bucket" in queries["ttft_p95_s"]
    assert 'owner_kind="ReplicaSet",owner_name=~"qwen-[a-z0-9]+"' in queries["restarts"]
    assert 'owner_name=~"qwen2\\\\.5\\\\-7b-[a-z0-9]+"' in snapshot_queries("a", "qwen2.5-7b", 30)[
        "restarts"
    ]
    assert 'reason="OOMKilled"' in queries["oom_kills"]


def test_answers_become_a_snapshot() -> None:
    snapshot, missing = snapshot_from_results(answers(ttft_p95_s=vector("NaN")), 60)
    assert missing == "" and snapshot is not None
    assert snapshot.pods == 2
    assert snapshot.ttft_p95_s is None  # no request got a first token: not a missing series
    assert snapshot.oom_kills == 1.0


def test_missing_engine_series_mean_no_snapshot_but_missing_ksm_is_fine() -> None:
    snapshot, missing = snapshot_from_results(answers(kv_cache_usage=[], ttft_p95_s=[]), 60)
    assert snapshot is None and missing == "kv_cache_usage, ttft_p95_s"
    snapshot, _ = snapshot_from_results(answers(pods=[]), 60)
    assert snapshot is None
    snapshot, _ = snapshot_from_results(answers(restarts=[], oom_kills=[]), 60)
    assert snapshot is not None and snapshot.oom_kills is None


def test_workload_status_keeps_the_tuner_condition() -> None:
    tuner = {"type": METRICS_AVAILABLE, "status": "False", "reason": "Unreachable",
             "message": "x", "lastTransitionTime": "2025-01-01T00:00:00Z"}  # fmt: skip
    llmd = {
        "metadata": {"name": "m", "namespace": "ns", "generation": 1},
        "spec": {"model": {"name": "m"}},
        "status": {"conditions": [tuner]},
    }
    status = workload_status(llmd, None, "2025-01-02T00:00:00Z")
    assert tuner in status["conditions"]
    assert [c["type"] for c in status["conditions"]][:3] == ["Available", "Progressing", "Degraded"]


class RecordingClient:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []

    async def request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        self.calls.append((method, path, kwargs.get("body")))
        return {}

    async def patch_status(self, path: str, status: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("PATCH", path + "/status", status))
        return {}


def run_window(mode: str, observation: Observation, status: dict[str, Any] | None = None):
    llmd = {
        "metadata": {"name": "m", "namespace": "ns"},
        "spec": {**spec(mode=mode), "replicas": 2},
        "status": status or {},
    }
    client, events = RecordingClient(), []

    async def observe(url: str, namespace: str, name: str, window_s: float) -> Observation:
        assert (url, namespace, name) == ("http://prometheus:9090", "ns", "m")
        return observation

    tuning = asyncio.run(
        runner.tune(
            client,  # type: ignore[arg-type]
            llmd,
            emit=lambda *event: events.append(event),
            logger=logging.getLogger("test"),
            window_s=60,
            observe_fn=observe,
        )
    )
    return tuning, client.calls, events


def test_runner_recommends_without_touching_the_spec() -> None:
    observation = Observation(QUEUED_WITH_FREE_KV)
    tuning, calls, _ = run_window("Recommend", observation)
    tuning, calls, events = run_window("Recommend", observation, {"tuning": tuning})
    assert [c[1] for c in calls] == [
        "/apis/pagoda.dev/v1alpha1/namespaces/ns/llmdeployments/m/status"
    ]
    assert tuning["recommendation"]["knob"] == MAX_NUM_SEQS
    entry = tuning["decisions"][-1]
    assert entry["outcome"] == "recommended" and entry["inputs"]["requestsWaiting"] == 40
    assert events == [
        ("Normal", "TuningRecommendation", entry["knob"] + " 64 -> 128: " + entry["reason"])
    ]
    # The same proposal next window: no second entry, no second Event.
    again, _, events = run_window("Recommend", observation, {"tuning": tuning})
    assert len(again["decisions"]) == 1 and events == []


def test_runner_applies_in_auto_mode() -> None:
    observation = Observation(QUEUED_WITH_FREE_KV)
    tuning, _, _ = run_window("Auto", observation)
    tuning, calls, events = run_window("Auto", observation, {"tuning": tuning})
    assert calls[0] == (
        "PATCH", "/apis/pagoda.dev/v1alpha1/namespaces/ns/llmdeployments/m",
        {"spec": {"engine": {"maxNumSeqs": 128}}},
    )  # fmt: skip
    assert tuning["decisions"][-1]["outcome"] == "watching"
    assert tuning["state"]["pending"]["to"] == 128
    assert events[0][1] == "TuningApplied"


def test_runner_holds_and_says_so_when_prometheus_is_unreachable() -> None:
    observation = Observation(
        None, "Prometheus at http://prometheus:9090 unreachable", "Unreachable"
    )
    tuning, calls, events = run_window("Auto", observation)
    assert len(calls) == 1  # the status only
    status = calls[0][2]
    condition = next(c for c in status["conditions"] if c["type"] == METRICS_AVAILABLE)
    assert (condition["status"], condition["reason"]) == ("False", "Unreachable")
    assert tuning["lastDecision"]["action"] == "hold"
    assert events == [("Warning", "MetricsUnreachable", condition["message"])]
