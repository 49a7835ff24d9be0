"""The tuner around the policy: spec -> limits, PromQL answers -> Snapshot, status and Events,
and one whole window of the runner against a recording client."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import logging
import time
from types import SimpleNamespace
from typing import Any

from k8s.emulated_cluster import merge_patch
from pagoda_operator import handlers
from pagoda_operator.desired import desired_objects
from pagoda_operator.kube import KubeError
from pagoda_operator.overrides import effective_spec
from pagoda_operator.spec import with_defaults
from pagoda_operator.status import workload_status
from pagoda_operator.tuning import runner
from pagoda_operator.tuning.knobs import (
    current_settings,
    limits_from_spec,
    overrides_in_force,
    overrides_patch,
    rollout_complete,
    with_change,
)
from pagoda_operator.tuning.policy import GPU_MEMORY_UTILIZATION, MAX_NUM_SEQS, REPLICAS
from pagoda_operator.tuning.prometheus import (
    Observation,
    snapshot_from_results,
    snapshot_queries,
)
from pagoda_operator.tuning.record import METRICS_AVAILABLE

from .policy_cases import QUEUED_WITH_FREE_KV, window


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


def test_limits_know_how_many_engines_a_rollout_takes_away() -> None:
    def unavailable(rollout: dict) -> int | None:
        user = spec()
        user["rollout"] = rollout
        return limits_from_spec(user).rollout_unavailable

    assert unavailable({"strategy": "RollingUpdate"}) == 1  # the product's default
    assert unavailable({"strategy": "RollingUpdate", "maxSurge": 1}) == 0
    assert unavailable({"strategy": "RollingUpdate", "maxSurge": 1, "maxUnavailable": 0}) == 0
    assert unavailable({"strategy": "RollingUpdate", "maxUnavailable": 2}) == 2
    assert unavailable({"strategy": "Recreate"}) is None


def test_overrides_hold_until_the_user_changes_the_knob_pins_it_or_leaves_auto() -> None:
    user = spec()
    overrides = with_change(user, {}, MAX_NUM_SEQS, 128.0)
    assert overrides == {MAX_NUM_SEQS: {"value": 128, "specValue": 64}}
    overrides = with_change(user, overrides, REPLICAS, 3)
    llmd = {"spec": user, "status": {"tuning": {"overrides": overrides}}}
    assert effective_spec(llmd)["engine"]["maxNumSeqs"] == 128
    assert effective_spec(llmd)["replicas"] == 3
    assert user["engine"]["maxNumSeqs"] == 64  # the spec as written stays the user's
    # Setting a knob back to the spec's value is no override at all.
    assert MAX_NUM_SEQS not in with_change(user, overrides, MAX_NUM_SEQS, 64)
    assert overrides_patch(overrides, {REPLICAS: overrides[REPLICAS]}) == {
        MAX_NUM_SEQS: None, REPLICAS: overrides[REPLICAS],
    }  # fmt: skip

    changed = {**llmd, "spec": {**user, "engine": {**user["engine"], "maxNumSeqs": 32}}}
    kept, dropped = overrides_in_force(with_defaults(changed["spec"]), changed)
    assert set(kept) == {REPLICAS} and "spec changed maxNumSeqs to 32" in dropped[MAX_NUM_SEQS]
    assert effective_spec(changed)["engine"]["maxNumSeqs"] == 32
    pinned = {**llmd, "spec": spec(pinned=["replicas"])}
    assert effective_spec(pinned)["replicas"] == 2
    recommend = {**llmd, "spec": spec(mode="Recommend")}
    assert effective_spec(recommend)["engine"]["maxNumSeqs"] == 64


def test_the_deployment_and_status_show_the_effective_values() -> None:
    llmd = {
        "metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 1},
        "spec": spec(),
        "status": {"tuning": {"overrides": with_change(spec(), {}, MAX_NUM_SEQS, 128)}},
    }
    settings, deployment = desired_objects(llmd, service_monitor_api=False)[:2]
    # Tuned (Auto): the flag reads the value in force from the settings ConfigMap.
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "$(PAGODA_MAX_NUM_SEQS)"
    assert settings["kind"] == "ConfigMap" and settings["data"]["maxNumSeqs"] == "128"
    effective = workload_status(llmd, deployment, "2025-01-01T00:00:00Z")["effective"]
    assert effective == {"replicas": 2, "maxNumSeqs": 128, "gpuMemoryUtilization": 0.9}


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
    assert (
        'owner_name=~"qwen2\\\\.5\\\\-7b-[a-z0-9]+"'
        in snapshot_queries("a", "qwen2.5-7b", 30)["restarts"]
    )
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


class FakeApi:
    """The LLMDeployment's API: GET and conditional status writes, recorded. ``interleave``
    runs once, between the tuner's read and its first write, as another writer would."""

    def __init__(self, llmd: dict[str, Any], interleave: Any = None,
                 pods: list[dict[str, Any]] | None = None) -> None:
        self.llmd = {**llmd, "metadata": {**llmd["metadata"], "resourceVersion": "1"}}
        self.calls: list[tuple[str, str, Any]] = []
        self.interleave = interleave
        # The engines' side for live changes: their pods and the admin Secret.
        self.pods = pods or []
        self.secrets: dict[str, dict[str, Any]] = {}

    async def get(self, path: str) -> dict[str, Any] | None:
        if "/secrets/" in path:
            return copy.deepcopy(self.secrets.get(path.rsplit("/", 1)[1]))
        self.calls.append(("GET", path, None))
        return copy.deepcopy(self.llmd)

    async def request(self, method: str, path: str, *, body: Any = None) -> dict[str, Any]:
        assert (method, path) == ("POST", "/api/v1/namespaces/ns/secrets")
        self.secrets[body["metadata"]["name"]] = body
        return copy.deepcopy(body)

    async def list(self, path: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        assert path == "/api/v1/namespaces/ns/pods" and labels["pagoda.dev/llmdeployment"] == "m"
        return copy.deepcopy(self.pods)

    async def patch_status(
        self, path: str, status: dict[str, Any], *, resource_version: str | None = None
    ) -> dict[str, Any]:
        if self.interleave is not None:
            self.interleave(self.llmd)
            self.interleave = None
            self.llmd["metadata"]["resourceVersion"] += "1"
        self.calls.append(("PATCH", path + "/status", status))
        if resource_version != self.llmd["metadata"]["resourceVersion"]:
            raise KubeError(409, "PATCH", path, "the object has been modified")
        self.llmd["status"] = merge_patch(self.llmd.get("status") or {}, status)
        self.llmd["metadata"]["resourceVersion"] += "1"
        return copy.deepcopy(self.llmd)


def run_window(
    mode: str,
    observation: Observation,
    status: dict[str, Any] | None = None,
    interleave: Any = None,
    now: float | None = None,
    engine: dict[str, Any] | None = None,
    pods: list[dict[str, Any]] | None = None,
    post_change: Any = None,
    secrets: dict[str, dict[str, Any]] | None = None,
    **tuning: Any,
):
    """``pods`` and ``post_change``: the engine pods and their admin API, for live changes
    (none by default: an engine-knob change then rolls out by restart)."""
    defaulted = spec(mode=mode, **tuning)
    defaulted["engine"].update(engine or {})
    llmd = {
        "metadata": {"name": "m", "namespace": "ns", "uid": "uid-m"},
        "spec": {**defaulted, "replicas": 2},
        "status": status or {},
    }
    api, events, applied = FakeApi(llmd, interleave, pods), [], []
    api.secrets.update(copy.deepcopy(secrets or {}))

    async def observe(endpoint: Any, namespace: str, name: str, window_s: float) -> Observation:
        assert (endpoint.url, namespace, name) == ("http://prometheus:9090", "ns", "m")
        return observation

    async def apply_owned(llmd: dict[str, Any]) -> None:
        applied.append(effective_spec(llmd))

    tuning_status = asyncio.run(
        runner.tune(
            api,  # type: ignore[arg-type]
            llmd,
            emit=lambda *event: events.append(event),
            logger=logging.getLogger("test"),
            window_s=60,
            apply_owned=apply_owned,
            observe_fn=observe,
            clock=time.time if now is None else lambda: now,
            **({"post_change": post_change} if post_change is not None else {}),
        )
    )
    return tuning_status, api, events, applied


STATUS_PATH = "/apis/pagoda.dev/v1alpha1/namespaces/ns/llmdeployments/m/status"


def test_runner_recommends_without_touching_the_spec() -> None:
    observation = Observation(QUEUED_WITH_FREE_KV)
    tuning, _, _, _ = run_window("Recommend", observation)
    tuning, api, events, applied = run_window("Recommend", observation, {"tuning": tuning})
    assert [c[:2] for c in api.calls][1:] == [("PATCH", STATUS_PATH)]
    assert applied == [] and api.llmd["spec"]["engine"]["maxNumSeqs"] == 64
    assert tuning["recommendation"]["knob"] == MAX_NUM_SEQS
    entry = tuning["decisions"][-1]
    assert entry["outcome"] == "recommended" and entry["inputs"]["requestsWaiting"] == 40
    assert events == [
        ("Normal", "TuningRecommendation", entry["knob"] + " 64 -> 128: " + entry["reason"])
    ]
    # The same proposal next window: no second entry, no second Event.
    again, _, events, _ = run_window("Recommend", observation, {"tuning": tuning})
    assert len(again["decisions"]) == 1 and events == []


def test_runner_applies_in_auto_mode_as_an_override_not_in_the_spec() -> None:
    observation = Observation(QUEUED_WITH_FREE_KV)
    tuning, _, _, _ = run_window("Auto", observation)
    tuning, api, events, applied = run_window("Auto", observation, {"tuning": tuning})
    assert api.llmd["spec"]["engine"]["maxNumSeqs"] == 64  # the user's, untouched
    assert api.llmd["status"]["tuning"]["overrides"] == {  # no engine pod: by restart
        MAX_NUM_SEQS: {"value": 128, "specValue": 64, "live": False}
    }
    assert [s["engine"]["maxNumSeqs"] for s in applied] == [128]  # the Deployment follows
    assert tuning["decisions"][-1]["outcome"] == "watching"
    assert tuning["state"]["pending"]["to"] == 128
    assert events[0][1] == "TuningApplied"


def test_the_tuner_leaves_a_deployment_at_zero_replicas_alone() -> None:
    """Scaled to zero (autoscaling.minReplicas 0): nothing is observed, decided or written."""
    earlier = {"mode": "Auto", "decisions": []}
    observation = Observation(QUEUED_WITH_FREE_KV)
    status = {"phase": "ScaledToZero", "tuning": earlier}
    tuning, api, events, applied = run_window("Auto", observation, status)
    assert tuning == earlier
    assert [c[0] for c in api.calls] == ["GET"] and events == [] and applied == []


def test_a_reconcile_in_flight_never_lands_a_deployment_from_before_the_tuners_write(
    monkeypatch: Any,
) -> None:
    """A reconcile (a spec change, an owned object's event) reads the LLMDeployment and,
    while it applies what it read, the tuner records an override and renders it. Were the
    two to overlap, the older render would land last: the engines rolled back to the old
    value, and forward again on the next reconcile (CI saw three restarts for one change)."""
    observation = Observation(QUEUED_WITH_FREE_KV)
    first, _, _, _ = run_window("Auto", observation)
    llmd = {
        "metadata": {"name": "m", "namespace": "ns", "uid": "uid-m"},
        "spec": {**spec(mode="Auto"), "replicas": 2},
        "status": {"tuning": first},
    }

    class Api(FakeApi):
        async def post_event(self, *_: Any) -> None:
            pass

    api = Api(llmd)
    started: list[int] = []
    rendered: list[int] = []

    async def reconcile(client: Any, current: dict[str, Any], **_: Any) -> None:
        read = await client.get(STATUS_PATH.removesuffix("/status"))
        started.append(1)
        if len(started) == 1:
            await asyncio.sleep(0.5)  # the first one is slow to apply what it read
        rendered.append(effective_spec(read)["engine"]["maxNumSeqs"])

    async def observe(*_: Any) -> Observation:
        return observation

    monkeypatch.setattr(handlers, "reconcile", reconcile)
    monkeypatch.setattr(runner, "tune", functools.partial(runner.tune, observe_fn=observe))
    memo = SimpleNamespace(client=api, default_image="engine", picker_image="picker",
                           service_monitors=False, monitor=None, tuner_events=set())  # fmt: skip

    async def run() -> None:
        spec_change = asyncio.create_task(
            handlers.reconcile_llmdeployment(body=llmd, memo=memo, logger=logging.getLogger("t"))
        )
        await asyncio.sleep(0)  # it has read the LLMDeployment
        await handlers.tune_llmdeployment(llmd, memo)
        await spec_change
        await asyncio.gather(*memo.tuner_events)

    asyncio.run(run())
    assert api.llmd["status"]["tuning"]["overrides"][MAX_NUM_SEQS]["value"] == 128
    assert rendered == [64, 128]  # the tuner's render is the last to land


def test_a_conflicting_write_is_decided_again_from_a_fresh_read() -> None:
    """Another write lands between the tuner's read and its write (here: the tuner's own
    previous window, recording the change it is watching). The write from the stale read is
    refused, and the window is decided again from the fresh state: the pending change and
    its cooldown survive, and nothing is applied twice."""
    observation = Observation(QUEUED_WITH_FREE_KV)
    first, _, _, _ = run_window("Auto", observation)
    watching, api, _, _ = run_window("Auto", observation, {"tuning": first})
    assert watching["state"]["pending"] is not None

    def lands_meanwhile(llmd: dict[str, Any]) -> None:
        llmd["status"] = copy.deepcopy(api.llmd["status"])

    tuning, stale_api, events, applied = run_window(
        "Auto", observation, {"tuning": first}, interleave=lands_meanwhile
    )
    assert [c[0] for c in stale_api.calls] == ["GET", "PATCH", "GET", "PATCH"]
    assert stale_api.llmd["status"]["tuning"]["state"]["pending"]["to"] == 128
    assert "waiting for the rollout of maxNumSeqs 64 -> 128" in tuning["lastDecision"]["reason"]
    assert applied == [] and [e for e in events if e[1] == "TuningApplied"] == []


def test_a_rollout_that_does_not_complete_in_time_is_reverted_and_banned() -> None:
    observation = Observation(QUEUED_WITH_FREE_KV)  # no engine ever reports the new value
    first, _, _, _ = run_window("Auto", observation, rolloutDeadlineSeconds=30)
    watching, api, _, _ = run_window(
        "Auto", observation, {"tuning": first}, rolloutDeadlineSeconds=30
    )
    status = copy.deepcopy(api.llmd["status"])
    status["tuning"]["state"]["pending"]["time"] -= 31
    tuning, api, events, applied = run_window(
        "Auto", observation, status, rolloutDeadlineSeconds=30
    )
    assert tuning["lastDecision"]["action"] == "revert"
    assert "rollout not complete" in tuning["lastDecision"]["reason"]
    assert not api.llmd["status"]["tuning"].get("overrides")  # back to the spec's 64
    assert [s["engine"]["maxNumSeqs"] for s in applied] == [64]
    assert tuning["banned"][0]["knob"] == MAX_NUM_SEQS and tuning["banned"][0]["value"] == 128
    assert ("Warning", "TuningReverted") in [e[:2] for e in events]


def test_a_change_whose_rollout_completes_is_judged_on_the_window_after_it_and_kept() -> None:
    """Each window starts from the status as the API server stored it: a key the last
    window wrote as None (``settledTime`` of a change not yet rolled out) is not there."""
    queued = Observation(QUEUED_WITH_FREE_KV)
    first, api, _, _ = run_window("Auto", queued, now=0)
    changed, api, _, _ = run_window("Auto", queued, copy.deepcopy(api.llmd["status"]), now=60)
    assert changed["decisions"][-1]["outcome"] == "watching"
    rolling, api, _, _ = run_window("Auto", queued, copy.deepcopy(api.llmd["status"]), now=120)
    assert rolling["lastDecision"]["reason"] == "waiting for the rollout of maxNumSeqs 64 -> 128"

    # Rolled out: the Deployment counts its pods updated and ready, and every engine
    # reports the new value; the queue is gone.
    status = {**api.llmd["status"], "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2}
    live = [{"max_num_seqs": "128", "gpu_memory_utilization": "0.9"}] * 2
    served = Observation(
        dataclasses.replace(QUEUED_WITH_FREE_KV, requests_waiting=0.0, ttft_p95_s=0.6), live=live
    )
    settling, api, _, _ = run_window("Auto", served, status, now=180)
    assert settling["lastDecision"]["reason"] == (
        "watching the first full window after maxNumSeqs 64 -> 128"
    )
    status = {**api.llmd["status"], "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2}
    judged, api, events, applied = run_window("Auto", served, status, now=240)
    verdict = "kept maxNumSeqs 64 -> 128: TTFT p95 2.5s -> 0.6s"
    assert judged["lastDecision"]["verdict"] == verdict
    assert [d["outcome"] for d in judged["decisions"]] == ["kept: " + verdict]
    assert ("Normal", "TuningKept", verdict) in events
    assert api.llmd["status"]["tuning"]["overrides"] == {  # no engine pod: by restart
        MAX_NUM_SEQS: {"value": 128, "specValue": 64, "live": False}
    }
    assert api.llmd["status"]["tuning"]["state"].get("pending") is None
    assert applied == []  # nothing to render again: the override stays as it is
    status = {**api.llmd["status"], "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2}
    later, api, events, _ = run_window("Auto", served, status, now=250)
    assert "verdict" not in api.llmd["status"]["tuning"]["lastDecision"]  # judged once
    assert [d["outcome"] for d in later["decisions"]] == ["kept: " + verdict]
    assert [e for e in events if e[1] == "TuningKept"] == []


def test_a_covered_engine_knob_change_lends_an_engine_for_its_rollout_and_gives_it_back() -> None:
    """The spec's rollout takes an engine down at a time (maxUnavailable 1): the runner
    first renders one engine more, then the bigger batch once it is Ready (the Deployment
    at 3 keeps 2 ready throughout), then 2 engines again once the change is kept; status
    and Events say each step and why."""
    calm = window(requests_running=50.0, kv_cache_usage=0.06, ttft_p95_s=0.1)

    def rolled_out(api: FakeApi, replicas: int, seqs: int) -> tuple[dict, list]:
        counts = {"replicas": replicas, "updatedReplicas": replicas, "readyReplicas": replicas}
        live = [{"max_num_seqs": str(seqs), "gpu_memory_utilization": "0.9"}] * replicas
        return {**copy.deepcopy(api.llmd["status"]), **counts}, live

    tp = {"tensorParallelSize": 2}  # raises are not live there: they still roll out
    first, api, _, _ = run_window("Auto", Observation(calm), now=0, engine=tp)
    status, live = rolled_out(api, 2, 64)
    lent, api, events, applied = run_window("Auto", Observation(calm, live=live), status, now=60,
                                            engine=tp)
    assert [(s["replicas"], s["engine"]["maxNumSeqs"]) for s in applied] == [(3, 64)]
    assert lent["state"]["cover"]["phase"] == "adding"
    assert events[0][1] == "TuningApplied" and events[0][2].startswith(
        "replicas 2 -> 3: 1 engines added to cover the rollout of maxNumSeqs 64 -> 128"
    )
    assert api.llmd["spec"]["replicas"] == 2  # the user's, untouched
    # The engine is Ready: the bigger batch, rendered on 3 engines.
    status, live = rolled_out(api, 3, 64)
    _, api, events, applied = run_window("Auto", Observation(calm, live=live), status, now=120,
                                         engine=tp)
    assert [(s["replicas"], s["engine"]["maxNumSeqs"]) for s in applied] == [(3, 128)]
    assert events == [
        ("Normal", "TuningKept", "1 engines added to cover the rollout of maxNumSeqs 64 -> 128 "
         "Ready"),
        ("Normal", "TuningApplied", events[1][2]),
        ("Normal", "TuningRollingRestart", events[2][2]),
    ]  # fmt: skip
    assert events[1][2].startswith("maxNumSeqs 64 -> 128: the 1 engines added to cover")
    # Rolled out, one full window, judged and kept: the engine goes back.
    status, live = rolled_out(api, 3, 128)
    _, api, _, _ = run_window("Auto", Observation(calm, live=live), status, now=180, engine=tp)
    status, live = rolled_out(api, 3, 128)
    judged, api, events, applied = run_window("Auto", Observation(calm, live=live), status, now=240,
                                              engine=tp)
    assert [(s["replicas"], s["engine"]["maxNumSeqs"]) for s in applied] == [(2, 128)]
    assert [e[1] for e in events] == ["TuningKept", "TuningApplied"]
    assert "giving back the 1 engines added to cover" in events[1][2]
    assert api.llmd["status"]["tuning"]["overrides"] == {  # no engine pod: by restart
        MAX_NUM_SEQS: {"value": 128, "specValue": 64, "live": False}
    }
    assert judged["state"].get("cover") is None
    assert [d["outcome"].split(":")[0] for d in judged["decisions"]] == ["kept", "kept", "watching"]


def test_each_window_replaces_what_the_last_one_wrote() -> None:
    """Through the API's merge patch, a field the last window wrote and this one leaves out
    (the knob of the last decision, the verdict of the change it judged, a knob no longer
    fixed) would stay as it was; the tuner removes it."""
    queued = Observation(QUEUED_WITH_FREE_KV)
    _, api, _, _ = run_window("Auto", queued, now=0)
    changed, api, _, _ = run_window("Auto", queued, copy.deepcopy(api.llmd["status"]), now=60)
    assert changed["lastDecision"]["knob"] == MAX_NUM_SEQS
    _, api, _, _ = run_window(
        "Auto", queued, copy.deepcopy(api.llmd["status"]), now=120, pinned=["replicas"]
    )
    stored = api.llmd["status"]["tuning"]
    assert stored["lastDecision"]["action"] == "hold"
    assert {"knob", "old", "new"}.isdisjoint(stored["lastDecision"])
    assert set(stored["fixed"]) == {REPLICAS}
    _, api, _, _ = run_window("Auto", queued, copy.deepcopy(api.llmd["status"]), now=130)
    assert "fixed" not in api.llmd["status"]["tuning"]  # unpinned
    assert api.llmd["status"]["tuning"]["state"]["pending"]["to"] == 128  # the rest stays


def test_engines_restarting_during_the_rollout_revert_it_at_once() -> None:
    observation = Observation(QUEUED_WITH_FREE_KV)
    first, _, _, _ = run_window("Auto", observation)
    _, api, _, _ = run_window("Auto", observation, {"tuning": first})
    crashing = Observation(dataclasses.replace(QUEUED_WITH_FREE_KV, restarts=2.0, oom_kills=0.0))
    tuning, api, events, _ = run_window("Auto", crashing, copy.deepcopy(api.llmd["status"]))
    assert tuning["lastDecision"]["action"] == "revert"
    assert "2 engine restarts while it rolled out" in tuning["lastDecision"]["reason"]


def test_a_user_change_to_a_knob_resets_the_override_and_the_change_under_watch() -> None:
    observation = Observation(QUEUED_WITH_FREE_KV)
    first, _, _, _ = run_window("Auto", observation)
    _, api, _, _ = run_window("Auto", observation, {"tuning": first})
    llmd = copy.deepcopy(api.llmd)
    llmd["spec"]["engine"]["maxNumSeqs"] = 32
    fresh = FakeApi(llmd)
    events: list[Any] = []
    applied: list[Any] = []

    async def observe(*_: Any) -> Observation:
        return observation

    async def apply_owned(llmd: dict[str, Any]) -> None:
        applied.append(effective_spec(llmd))

    asyncio.run(
        runner.tune(
            fresh,  # type: ignore[arg-type]
            llmd,
            emit=lambda *event: events.append(event),
            logger=logging.getLogger("test"),
            window_s=60,
            apply_owned=apply_owned,
            observe_fn=observe,
        )
    )
    tuning = fresh.llmd["status"]["tuning"]
    assert MAX_NUM_SEQS not in (tuning.get("overrides") or {})
    assert tuning["state"].get("pending") is None
    assert [s["engine"]["maxNumSeqs"] for s in applied] == [32]
    assert events[0][1] == "TuningOverrideReset"


def test_runner_holds_and_says_so_when_prometheus_is_unreachable() -> None:
    observation = Observation(
        None, "Prometheus at http://prometheus:9090 unreachable", "Unreachable"
    )
    tuning, api, events, _ = run_window("Auto", observation)
    assert [c[0] for c in api.calls] == ["GET", "PATCH"]  # the status only
    status = api.calls[-1][2]
    condition = next(c for c in status["conditions"] if c["type"] == METRICS_AVAILABLE)
    assert (condition["status"], condition["reason"]) == ("False", "Unreachable")
    assert tuning["lastDecision"]["action"] == "hold"
    assert events == [("Warning", "MetricsUnreachable", condition["message"])]


def engine_pod(name: str, ip: str, ready: bool = True) -> dict[str, Any]:
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    return {"metadata": {"name": name}, "status": {"podIP": ip, "conditions": [condition]}}


class AdminApis:
    """The engines' admin APIs: records each change asked of them; ``refuse`` maps a pod
    address to the (status, message) its engine answers instead of applying."""

    def __init__(self, refuse: dict[str, tuple[int, str]] | None = None) -> None:
        self.posts: list[tuple[str, str, dict[str, Any]]] = []
        self.refuse = refuse or {}

    async def __call__(self, url: str, key: str, body: dict[str, Any]):
        self.posts.append((url, key, body))
        address = url.split("//", 1)[1].split(":", 1)[0]
        if address in self.refuse:
            status, message = self.refuse[address]
            return status, {"error": {"message": message}}
        return 200, {"status": "applied", "seconds": 0.02, "plan": {"capture_needed": False}}


PODS = [engine_pod("m-b", "10.0.0.2"), engine_pod("m-a", "10.0.0.1"),
        engine_pod("m-c", "10.0.0.3", ready=False)]  # fmt: skip


def test_an_engine_knob_change_is_made_live_pod_by_pod_judged_and_restarts_nothing() -> None:
    queued = Observation(QUEUED_WITH_FREE_KV)
    admin = AdminApis()
    _, api, _, _ = run_window("Auto", queued, now=0, pods=PODS, post_change=admin)
    before = desired_objects(api.llmd, service_monitor_api=False)
    changed, api, events, applied = run_window(
        "Auto", queued, copy.deepcopy(api.llmd["status"]), now=60, pods=PODS, post_change=admin)
    # Ready pods only, one after the other, by address and with the Secret's key.
    assert [post[0] for post in admin.posts] == [
        "http://10.0.0.1:8001/admin/engine-config", "http://10.0.0.2:8001/admin/engine-config"]
    assert {post[2]["max_num_seqs"] for post in admin.posts} == {128}
    assert len({post[1] for post in admin.posts}) == 1 and len(admin.posts[0][1]) >= 32
    assert api.llmd["status"]["tuning"]["overrides"] == {
        MAX_NUM_SEQS: {"value": 128, "specValue": 64, "live": True}}
    assert [e[1] for e in events] == ["TuningApplied", "TuningAppliedLive"]
    assert "m-a in 0.02s; m-b in 0.02s" in events[1][2]
    assert changed["decisions"][-1]["applied"].startswith("applied live")
    # The pods start tuned (the ConfigMap says 128) but the pod template is unchanged.
    after = desired_objects(api.llmd, service_monitor_api=False)
    assert after[0]["data"]["maxNumSeqs"] == "128" and before[0]["data"]["maxNumSeqs"] == "64"
    assert after[1]["spec"]["template"] == before[1]["spec"]["template"]
    assert [s["engine"]["maxNumSeqs"] for s in applied] == [128]
    # Every engine reports the new value: judged on the full window after it, and kept.
    status = {**copy.deepcopy(api.llmd["status"]), "replicas": 2, "updatedReplicas": 2,
              "readyReplicas": 2}  # fmt: skip
    live = Observation(QUEUED_WITH_FREE_KV,
                       live=[{"max_num_seqs": "128", "gpu_memory_utilization": "0.9"}] * 2)
    for now in (120, 180):
        judged, api, events, _ = run_window("Auto", live, status, now=now, pods=PODS,
                                            post_change=admin)  # fmt: skip
        status = {**copy.deepcopy(api.llmd["status"]), **{k: 2 for k in (
            "replicas", "updatedReplicas", "readyReplicas")}}  # fmt: skip
    assert judged["decisions"][-1]["outcome"].startswith("kept")


def test_a_change_an_engine_cannot_take_live_rolls_out_by_restart() -> None:
    queued = Observation(QUEUED_WITH_FREE_KV)
    admin = AdminApis(refuse={"10.0.0.2": (409, "takes only lower batch limits live")})
    _, api, _, _ = run_window("Auto", queued, now=0, pods=PODS, post_change=admin)
    before = desired_objects(api.llmd, service_monitor_api=False)[1]
    _, api, events, _ = run_window("Auto", queued, copy.deepcopy(api.llmd["status"]), now=60,
                                   pods=PODS, post_change=admin)  # fmt: skip
    assert len(admin.posts) == 2  # the first pod took it; the second refused
    override = api.llmd["status"]["tuning"]["overrides"][MAX_NUM_SEQS]
    assert override == {"value": 128, "specValue": 64, "live": False}
    assert events[-1][1] == "TuningRollingRestart"
    assert "m-b: HTTP 409: takes only lower batch limits live" in events[-1][2]
    after = desired_objects(api.llmd, service_monitor_api=False)[1]
    annotation = "pagoda.dev/engine-settings"
    template = after["spec"]["template"]["metadata"]["annotations"]
    assert template[annotation] != before["spec"]["template"]["metadata"]["annotations"][annotation]
