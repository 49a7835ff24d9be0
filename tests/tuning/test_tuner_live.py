"""The tuner with real parts: two CPU engine servers under `pagoda bench serve` load, a real
Prometheus scraping them, and a real `kopf run` of the operator against the kmock API
emulator. The operator must read the engines' queue from Prometheus and record a decision,
with its inputs, in status.tuning: first as a recommendation, then applied in Auto mode as an
override (the spec stays the user's), and reverted when its rollout does not complete in
time. A second LLMDeployment shows the GitOps case: re-applying the user's manifest neither
undoes the override nor restarts the engines, and a user's change to the knob resets it. A
third one shows a change that rolls out, is judged on the windows after its rollout, and
is kept.

Prometheus labels the two engines the way the Kubernetes relabelling in operator/README.md
labels an LLMDeployment's pods: namespace="tuned", llmdeployment="smol-lm" (a hyphenated name,
as almost every Kubernetes name is), and once more for each of the other LLMDeployments.

The emulated API server has no controller manager or kubelet: the engines are the pods, and
where a rollout is to complete the test plays their part (see ``Engines.roll_out``). That
restarts the engines with the new flags, so the test that does it runs after those that
need them at 4 batch slots.

Every wait is on a condition, with deadlines meant for a loaded 2-core machine.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from k8s.conftest import REPO_ROOT, kopf_run_command, operator_attached
from k8s.emulated_cluster import EmulatedCluster, wait_for
from k8s.test_operator_kmock import (
    deployment_path,
    engine_container,
    event_messages,
    flag_value,
    granted_permissions,
    llmd_path,
    llmd_status,
    used_permissions,
)
from prometheus_process import running_prometheus, stop
from server.server_harness import free_port, start_subprocess_server

NAMESPACE, NAME, GITOPS, KEPT = "tuned", "smol-lm", "smol-lm-gitops", "smol-lm-kept"
# Long enough for the slowest step under load, short enough to keep a failing run short.
DEADLINE_S = 180
MODEL = "SmolLM2-135M-Instruct"
# Short windows so the test takes about a minute: a look every 2 s over the last 4 s.
TUNER_ENV = {"PAGODA_TUNING_INTERVAL_SECONDS": "2", "PAGODA_TUNING_WINDOW_SECONDS": "4"}

pytestmark = pytest.mark.slow


class Engines:
    """The two engine servers, which stand for the pods of every LLMDeployment here."""

    def __init__(self, max_num_seqs: int, logs: Path) -> None:
        self.logs = [logs / f"engine-{index}.log" for index in range(2)]
        self.processes: list[subprocess.Popen] = []
        self.urls: list[str] = []
        with ThreadPoolExecutor(2) as pool:
            for process, url in pool.map(lambda log: start_engine(max_num_seqs, log), self.logs):
                self.processes.append(process)
                self.urls.append(url)

    def roll_out(self, max_num_seqs: int) -> None:
        """What a rollout does to the pods: each engine stops as a pod is stopped (SIGTERM:
        it drains what is in flight and refuses what comes) and a new one starts in its
        place, on the same address, with the new flags. Returns once both are ready."""

        def replace(index: int) -> None:
            stop(self.processes[index])
            port = int(self.urls[index].rsplit(":", 1)[1])
            self.processes[index], _ = start_engine(max_num_seqs, self.logs[index], port)

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(replace, range(2)))

    def stop(self) -> None:
        for process in self.processes:
            stop(process)


def start_engine(
    max_num_seqs: int, log: Path, port: int | None = None
) -> tuple[subprocess.Popen, str]:
    args = ("--max-num-seqs", str(max_num_seqs), "--max-model-len", "512")
    return start_subprocess_server(
        "default", *args, "--uvicorn-log-level", "warning", port=port, log_path=log
    )


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    """Two engines with 4 batch slots each: a few requests per second make them queue."""
    started = Engines(max_num_seqs=4, logs=tmp_path_factory.mktemp("engines"))
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def prometheus(engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    targets = ", ".join(f"'{url.removeprefix('http://')}'" for url in engines.urls)
    names = (NAME, GITOPS, KEPT)
    groups = "".join(
        f"      - targets: [{targets}]\n"
        f"        labels: {{namespace: {NAMESPACE}, llmdeployment: {name}}}\n"
        for name in names
    )
    jobs = "  - job_name: pagoda-engines\n    static_configs:\n" + groups
    with running_prometheus(tmp_path_factory.mktemp("prometheus"), jobs) as url:
        wait_for(
            lambda: scraped_engines(url) == 2 * len(names),
            timeout=DEADLINE_S,
            what="engines scraped",
        )
        yield url


def scraped_engines(url: str) -> int:
    try:
        response = httpx.get(f"{url}/api/v1/query", params={"query": "sum(up)"}, timeout=2)
        result = response.json()["data"]["result"]
    except (httpx.HTTPError, ValueError, KeyError):
        return 0
    return int(float(result[0]["value"][1])) if result else 0


@pytest.fixture(scope="module")
def load(prometheus: str, engines: Engines, tmp_path_factory: pytest.TempPathFactory):
    """`pagoda bench serve` at 3 requests/s on each engine, for longer than the test runs
    (the requests sent while the engines restart fail)."""
    log = tmp_path_factory.mktemp("bench") / "bench.log"
    processes = []
    with open(log, "w") as out:
        for base_url in engines.urls:
            command = [
                sys.executable, "-m", "inference.cli", "bench", "serve", "--base-url", base_url,
                "--num-prompts", "5000", "--request-rate", "3", "--input-len", "32",
                "--output-len", "16", "--request-timeout-s", "300",
            ]  # fmt: skip
            processes.append(subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=out))
    try:
        yield
    finally:
        for process in processes:
            stop(process)


@pytest.fixture(scope="module")
def cluster(load: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatedCluster]:
    saved = {key: os.environ.get(key) for key in TUNER_ENV}
    os.environ.update(TUNER_ENV)
    try:
        with operator_attached(tmp_path_factory.mktemp("kmock"), kopf_run_command) as emulated:
            yield emulated
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def tuned_llmd(name: str, prometheus_url: str, mode: str, **tuning: Any) -> dict[str, Any]:
    return {
        "apiVersion": "pagoda.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"name": MODEL},
            "replicas": 2,
            "engine": {"device": "cpu", "maxNumSeqs": 4, "maxModelLen": 512},
            "tuning": {
                "mode": mode,
                "cooldownSeconds": 5,
                "pinned": ["replicas"],
                "bounds": {"maxNumSeqs": {"min": 2, "max": 16}},
                "slo": {"ttftP95Seconds": 0.5},
                **tuning,
            },
            "prometheus": {"url": prometheus_url},
        },
    }


def tuning(cluster: EmulatedCluster, name: str = NAME) -> dict[str, Any]:
    return llmd_status(cluster, NAMESPACE, name).get("tuning") or {}


def metrics_condition(cluster: EmulatedCluster, name: str) -> dict[str, Any]:
    conditions = llmd_status(cluster, NAMESPACE, name).get("conditions") or []
    return next((c for c in conditions if c["type"] == "MetricsAvailable"), {})


def decision_with(cluster: EmulatedCluster, outcome: str, name: str = NAME) -> dict | None:
    return next(
        (d for d in tuning(cluster, name).get("decisions") or [] if d["outcome"] == outcome),
        None,
    )


def deployed_max_num_seqs(cluster: EmulatedCluster, name: str) -> str | None:
    deployment = cluster.get(deployment_path(NAMESPACE, name))
    if deployment is None:
        return None
    value = flag_value(engine_container(deployment)["args"], "--max-num-seqs")
    if value.startswith("$("):  # tuned: the pods read it from the settings ConfigMap
        settings = cluster.get(f"/api/v1/namespaces/{NAMESPACE}/configmaps/{name}-engine-settings")
        return ((settings or {}).get("data") or {}).get("maxNumSeqs")
    return value


def user_max_num_seqs(cluster: EmulatedCluster, name: str) -> int:
    return (cluster.get(llmd_path(NAMESPACE, name)) or {})["spec"]["engine"]["maxNumSeqs"]


def deployment_updates(cluster: EmulatedCluster, name: str) -> list[str]:
    return [m for m in events(cluster) if m.startswith(f"Updated: Updated Deployment {name}:")]


def evaluations_after(cluster: EmulatedCluster, name: str, count: int) -> Any:
    """Waits until the tuner has looked at ``name`` ``count`` more times."""
    seen: list[str] = []

    def looked() -> bool:
        stamp = tuning(cluster, name).get("lastDecision", {}).get("time")
        if stamp and (not seen or seen[-1] != stamp):
            seen.append(stamp)
        return len(seen) > count

    return wait_for(looked, timeout=DEADLINE_S, interval=0.2, what=f"{count} tuner windows")


def test_recommend_then_auto_then_revert_of_a_rollout_that_never_completes(
    cluster: EmulatedCluster, prometheus: str
) -> None:
    manifest = tuned_llmd(NAME, prometheus, "Recommend", rolloutDeadlineSeconds=20)
    cluster.create(llmd_path(NAMESPACE), manifest)
    recommended = wait_for(
        lambda: decision_with(cluster, "recommended"), timeout=DEADLINE_S, what="a recommendation"
    )
    assert (recommended["knob"], recommended["from"], recommended["to"]) == ("maxNumSeqs", 4, 8)
    inputs = recommended["inputs"]
    assert inputs["pods"] == 2
    assert inputs["requestsWaiting"] > 0 and inputs["requestsRunning"] > 0
    assert inputs["kvCacheUsage"] < 0.75
    assert inputs["restarts"] is None  # no kube-state-metrics here
    assert "every batch slot busy" in recommended["reason"]
    assert metrics_condition(cluster, NAME)["status"] == "True"
    assert tuning(cluster)["recommendation"]["to"] == 8
    # Recommend never touches the Deployment.
    assert deployed_max_num_seqs(cluster, NAME) == "4"
    wait_for(
        lambda: any(
            m.startswith("TuningRecommendation: maxNumSeqs 4 -> 8") for m in events(cluster)
        ),
        timeout=DEADLINE_S,
        what="the event",
    )

    cluster.patch(llmd_path(NAMESPACE, NAME), {"spec": {"tuning": {"mode": "Auto"}}})
    applied = wait_for(
        lambda: decision_with(cluster, "watching"), timeout=DEADLINE_S, what="a change"
    )
    assert (applied["knob"], applied["from"], applied["to"], applied["mode"]) == (
        "maxNumSeqs", 4, 8, "Auto",
    )  # fmt: skip
    assert applied["inputs"]["requestsWaiting"] > 0
    wait_for(
        lambda: deployed_max_num_seqs(cluster, NAME) == "8",
        timeout=DEADLINE_S,
        what="the Deployment rolled to --max-num-seqs 8",
    )
    assert user_max_num_seqs(cluster, NAME) == 4  # the spec stays the user's
    wait_for(
        lambda: any(m.startswith("TuningApplied: maxNumSeqs 4 -> 8") for m in events(cluster)),
        timeout=DEADLINE_S,
        what="the event",
    )
    # The engines here are not pods the Deployment could restart: they keep reporting 4
    # slots, so the rollout never completes and the change is reverted at its deadline.
    reverted = wait_for(
        lambda: decision_with(cluster, "applied"), timeout=DEADLINE_S, what="the revert"
    )
    assert (reverted["action"], reverted["knob"], reverted["to"]) == ("revert", "maxNumSeqs", 4)
    assert "rollout not complete" in reverted["reason"]
    wait_for(
        lambda: deployed_max_num_seqs(cluster, NAME) == "4",
        timeout=DEADLINE_S,
        what="the Deployment back at --max-num-seqs 4",
    )
    status = tuning(cluster)
    assert not status.get("overrides")
    assert [(b["knob"], b["value"]) for b in status["banned"]] == [("maxNumSeqs", 8)]
    wait_for(
        lambda: any(
            m.startswith("TuningReverted: maxNumSeqs 8 -> 4: reverted maxNumSeqs 4 -> 8: rollout")
            for m in events(cluster)
        ),
        timeout=DEADLINE_S,
        what="the TuningReverted event",
    )
    # 8 is banned: the tuner does not try it again, though the queue is still there.
    evaluations_after(cluster, NAME, 3)
    assert deployed_max_num_seqs(cluster, NAME) == "4"


def test_gitops_reapply_keeps_the_override_and_a_user_change_resets_it(
    cluster: EmulatedCluster, prometheus: str
) -> None:
    # A long cooldown and deadline: one change, watched for the whole test.
    manifest = tuned_llmd(
        GITOPS, prometheus, "Auto", cooldownSeconds=3600, rolloutDeadlineSeconds=3600
    )
    cluster.create(llmd_path(NAMESPACE), manifest)
    wait_for(
        lambda: deployed_max_num_seqs(cluster, GITOPS) == "8",
        timeout=DEADLINE_S,
        what="the tuner's maxNumSeqs 8 in the Deployment",
    )
    llmd = cluster.get(llmd_path(NAMESPACE, GITOPS)) or {}
    assert llmd["spec"]["engine"]["maxNumSeqs"] == 4
    # No engine pod in the emulated cluster to take it live: it rolled out by restart.
    assert llmd["status"]["tuning"]["overrides"]["maxNumSeqs"] == {
        "value": 8, "specValue": 4, "live": False}
    wait_for(
        lambda: (
            (llmd_status(cluster, NAMESPACE, GITOPS).get("effective") or {}).get("maxNumSeqs") == 8
        ),
        timeout=DEADLINE_S,
        what="status.effective.maxNumSeqs 8 (the MaxSeqs printer column)",
    )
    updates = len(deployment_updates(cluster, GITOPS))

    # `kubectl apply` of the user's manifest, as a GitOps controller does on every sync.
    cluster.patch(llmd_path(NAMESPACE, GITOPS), {"spec": manifest["spec"]})
    evaluations_after(cluster, GITOPS, 2)
    assert deployed_max_num_seqs(cluster, GITOPS) == "8"
    assert len(deployment_updates(cluster, GITOPS)) == updates  # no restart, no fight

    # The user changes something else: the Deployment is rendered again, with the override.
    edited = {**manifest["spec"], "env": [{"name": "TEAM", "value": "search"}]}
    cluster.patch(llmd_path(NAMESPACE, GITOPS), {"spec": edited})
    wait_for(
        lambda: len(deployment_updates(cluster, GITOPS)) > updates,
        timeout=DEADLINE_S,
        what="the Deployment updated for the new env",
    )
    assert deployed_max_num_seqs(cluster, GITOPS) == "8"

    # The user changes the knob itself: the user's value wins and the override goes.
    cluster.patch(llmd_path(NAMESPACE, GITOPS), {"spec": {"engine": {"maxNumSeqs": 6}}})
    wait_for(
        lambda: deployed_max_num_seqs(cluster, GITOPS) == "6",
        timeout=DEADLINE_S,
        what="the user's maxNumSeqs 6 in the Deployment",
    )
    wait_for(
        lambda: "maxNumSeqs" not in (tuning(cluster, GITOPS).get("overrides") or {}),
        timeout=DEADLINE_S,
        what="the override dropped from status",
    )
    wait_for(
        lambda: any(m.startswith("TuningOverrideReset: maxNumSeqs") for m in events(cluster)),
        timeout=DEADLINE_S,
        what="the TuningOverrideReset event",
    )
    assert deployed_max_num_seqs(cluster, GITOPS) == "6"


def test_unreachable_prometheus_or_missing_series_hold_and_say_so(
    cluster: EmulatedCluster, prometheus: str
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    # With a bearer token from a Secret, as a managed Prometheus needs: the tuner reads it.
    cluster.create(
        f"/api/v1/namespaces/{NAMESPACE}/secrets",
        {"apiVersion": "v1", "kind": "Secret",
         "metadata": {"name": "prometheus-token", "namespace": NAMESPACE},
         "data": {"token": base64.b64encode(b"s3cret").decode()}},
    )  # fmt: skip
    nowhere = tuned_llmd("nowhere", dead, "Auto")
    nowhere["spec"]["prometheus"]["bearerTokenSecretRef"] = {
        "name": "prometheus-token",
        "key": "token",
    }
    cluster.create(llmd_path(NAMESPACE), nowhere)
    cluster.create(llmd_path(NAMESPACE), tuned_llmd("unlabelled", prometheus, "Auto"))
    unreachable = wait_for(
        lambda: (
            metrics_condition(cluster, "nowhere").get("reason") == "Unreachable"
            and metrics_condition(cluster, "nowhere")
        ),
        timeout=DEADLINE_S,
        what="MetricsAvailable=False for an unreachable Prometheus",
    )
    assert unreachable["status"] == "False"
    assert "Holding every knob steady" in unreachable["message"]
    missing = wait_for(
        lambda: (
            metrics_condition(cluster, "unlabelled").get("reason") == "SeriesMissing"
            and metrics_condition(cluster, "unlabelled")
        ),
        timeout=DEADLINE_S,
        what="MetricsAvailable=False for series that are not there",
    )
    assert 'llmdeployment="unlabelled"' in missing["message"]
    for name in ("nowhere", "unlabelled"):
        assert tuning(cluster, name).get("decisions") in (None, [])
        spec = (cluster.get(llmd_path(NAMESPACE, name)) or {})["spec"]
        assert spec["engine"]["maxNumSeqs"] == 4
    wait_for(
        lambda: any(m.startswith("MetricsUnreachable") for m in events(cluster)),
        timeout=DEADLINE_S,
        what="the MetricsUnreachable event",
    )


def test_auto_change_that_rolls_out_is_judged_on_the_windows_after_it_and_kept(
    cluster: EmulatedCluster, prometheus: str, engines: Engines
) -> None:
    # The default cooldown, and maxNumSeqs may go no higher than 8: one change in this test.
    manifest = tuned_llmd(
        KEPT, prometheus, "Auto", cooldownSeconds=600, bounds={"maxNumSeqs": {"min": 2, "max": 8}}
    )
    cluster.create(llmd_path(NAMESPACE), manifest)
    wait_for(
        lambda: cluster.get(deployment_path(NAMESPACE, KEPT)),
        timeout=DEADLINE_S,
        what="the Deployment",
    )
    pods_status(cluster, KEPT, updated=2, ready=2)  # the engines serve it already

    applied = wait_for(
        lambda: decision_with(cluster, "watching", KEPT), timeout=DEADLINE_S, what="a change"
    )
    assert (applied["action"], applied["knob"], applied["from"], applied["to"]) == (
        "change", "maxNumSeqs", 4, 8,
    )  # fmt: skip
    assert applied["inputs"]["requestsWaiting"] > 0
    wait_for(
        lambda: deployed_max_num_seqs(cluster, KEPT) == "8",
        timeout=DEADLINE_S,
        what="the Deployment rolled to --max-num-seqs 8",
    )
    # Nothing is judged while the engines still run the old value.
    wait_for(
        lambda: last_reason(cluster, KEPT).startswith("waiting for the rollout of maxNumSeqs"),
        timeout=DEADLINE_S,
        what="the tuner waiting for the rollout",
    )
    assert decision_with(cluster, "watching", KEPT) is not None

    # The rollout, as the controller manager and the kubelet would do it: the pods go, new
    # ones start with --max-num-seqs 8 and the Deployment counts them once they are ready.
    pods_status(cluster, KEPT, updated=0, ready=0)
    engines.roll_out(max_num_seqs=8)
    # Ready once each new engine has served a few requests: a CPU engine's first batches
    # of each new size run slow (the kernels' first calls), and the window judged is the
    # first after the rollout; on a loaded 2-core box that start once halved the tokens
    # measured there, and the change was reverted.
    wait_for(
        lambda: all(finished_requests(url) >= 6 for url in engines.urls),
        timeout=DEADLINE_S,
        what="both new engines serving",
    )
    pods_status(cluster, KEPT, updated=2, ready=2)
    wait_for(
        lambda: live_max_num_seqs(prometheus, KEPT) == {"8"},
        timeout=DEADLINE_S,
        what="Prometheus seeing both engines at --max-num-seqs 8",
    )

    kept = wait_for(
        lambda: next(
            (
                d for d in tuning(cluster, KEPT).get("decisions") or []
                if d["outcome"].startswith("kept: ")
            ),
            None,
        ),
        timeout=DEADLINE_S,
        what=lambda: f"the change judged and kept (tuning status: {tuning(cluster, KEPT)})",
    )  # fmt: skip
    assert (kept["action"], kept["knob"], kept["from"], kept["to"], kept["mode"]) == (
        "change", "maxNumSeqs", 4, 8, "Auto",
    )  # fmt: skip
    verdict = kept["outcome"].removeprefix("kept: ")
    assert verdict.startswith("kept maxNumSeqs 4 -> 8: "), verdict
    wait_for(
        lambda: f"TuningKept: {verdict}" in events(cluster),
        timeout=DEADLINE_S,
        what="the TuningKept event",
    )
    # Kept: the override stays, the spec is the user's, and the engines keep running 8.
    evaluations_after(cluster, KEPT, 2)
    status = tuning(cluster, KEPT)
    assert status["overrides"] == {"maxNumSeqs": {"value": 8, "specValue": 4, "live": False}}
    assert not status.get("banned")
    assert [d["outcome"] for d in status["decisions"]] == [kept["outcome"]]
    assert user_max_num_seqs(cluster, KEPT) == 4
    assert deployed_max_num_seqs(cluster, KEPT) == "8"
    assert llmd_status(cluster, NAMESPACE, KEPT)["effective"]["maxNumSeqs"] == 8


def pods_status(cluster: EmulatedCluster, name: str, *, updated: int, ready: int) -> None:
    """The Deployment's status as the controller manager writes it for its current
    generation: of its 2 pods, ``updated`` run the current template, ``ready`` are ready."""
    path = deployment_path(NAMESPACE, name)
    generation = (cluster.get(path) or {})["metadata"]["generation"]
    status = {
        "observedGeneration": generation,
        "replicas": 2,
        "updatedReplicas": updated,
        "readyReplicas": ready,
        "availableReplicas": ready,
    }
    cluster.patch(path + "/status", {"status": status})


def finished_requests(engine_url: str) -> float:
    """Requests the engine has finished since it started (``vllm:request_success``)."""
    try:
        text = httpx.get(f"{engine_url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{")
    )


def live_max_num_seqs(prometheus: str, name: str) -> set[str]:
    """The maxNumSeqs each engine of ``name`` reports, as the tuner reads them."""
    query = f'pagoda:engine_config_info{{namespace="{NAMESPACE}",llmdeployment="{name}"}}'
    response = httpx.get(f"{prometheus}/api/v1/query", params={"query": query}, timeout=10)
    return {item["metric"]["max_num_seqs"] for item in response.json()["data"]["result"]}


def last_reason(cluster: EmulatedCluster, name: str) -> str:
    return tuning(cluster, name).get("lastDecision", {}).get("reason", "")


def test_tuner_calls_stay_within_the_cluster_role(cluster: EmulatedCluster) -> None:
    granted = granted_permissions()
    used = used_permissions(cluster)
    assert used <= granted, sorted(used - granted)
    assert ("", "secrets", "get") in used  # the bearer token of "nowhere"


def events(cluster: EmulatedCluster) -> list[str]:
    return event_messages(cluster, NAMESPACE)
