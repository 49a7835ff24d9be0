"""The operator's replicas and scope: kopf's peering between replicas (only the leader acts,
the tuner included), a disruption budget, and a namespace-scoped install."""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import kubernetes_validate
import pytest
from pagoda_operator.peering import (
    RunOptions,
    kopf_run_arguments,
    leads,
    led_llmdeployments,
    parse_run_options,
)

from .conftest import CHART, load_documents
from .test_helm import by_kind, render
from .test_manifests import KUBERNETES_VERSIONS

NOW = datetime.datetime(2026, 1, 1, 12, 0, tzinfo=datetime.UTC)
PEERING_CRDS = CHART / "crds" / "kopf-peerings.yaml"


def operator_args(documents: list[dict[str, Any]]) -> list[str]:
    (deployment,) = by_kind(documents, "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_two_replicas_with_peering_and_a_disruption_budget(helm: str) -> None:
    documents = render(helm, [])
    (deployment,) = by_kind(documents, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    pod = deployment["spec"]["template"]["spec"]
    env = {item["name"]: item for item in pod["containers"][0]["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    options = parse_run_options(operator_args(documents), {})
    (peering,) = by_kind(documents, "ClusterKopfPeering")
    assert options.peering == peering["metadata"]["name"] and options.namespaces == ()
    assert kopf_run_arguments(options)["standalone"] is False
    assert kopf_run_arguments(options)["clusterwide"] is True
    (budget,) = by_kind(documents, "PodDisruptionBudget")
    assert budget["spec"]["minAvailable"] == 1
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # A single replica gets no budget: minAvailable 1 of 1 would block every node drain.
    assert by_kind(render(helm, ["--set", "replicaCount=1"]), "PodDisruptionBudget") == []


def test_namespace_scoped_install_grants_nothing_cluster_wide(helm: str) -> None:
    documents = render(helm, ["--set", "watchNamespaces={team-a,team-b}"])
    options = parse_run_options(operator_args(documents), {})
    assert options.namespaces == ("team-a", "team-b")
    assert kopf_run_arguments(options)["clusterwide"] is False
    assert kopf_run_arguments(options)["namespaces"] == ["team-a", "team-b"]
    # Only the aggregated user roles stay cluster-wide; the operator has Roles alone.
    assert not by_kind(documents, "ClusterRoleBinding")
    assert {r["metadata"]["name"] for r in by_kind(documents, "ClusterRole")} == {
        "pagoda-pagoda-operator-llmdeployments-view",
        "pagoda-pagoda-operator-llmdeployments-edit",
    }
    roles = by_kind(documents, "Role")
    assert {(r["metadata"]["namespace"], r["metadata"]["name"]) for r in roles} == {
        (ns, name)
        for ns in ("team-a", "team-b")
        for name in ("pagoda-pagoda-operator", "pagoda-pagoda-operator-peering")
    }
    for binding in by_kind(documents, "RoleBinding"):
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["subjects"][0]["namespace"] == "pagoda-system"
    peerings = by_kind(documents, "KopfPeering")
    assert {p["metadata"]["namespace"] for p in peerings} == {"team-a", "team-b"}
    assert not by_kind(documents, "ClusterKopfPeering")


@pytest.mark.parametrize("values", [[], ["--set", "watchNamespaces={team-a}"]])
def test_secrets_are_only_read_one_by_one(helm: str, values: list[str]) -> None:
    """The operator reads only the Secrets it is told of by name: the Prometheus token and
    CA an LLMDeployment names, and the admin key it created for a tuned LLMDeployment's
    engines (model credentials and API keys reach the pods through secretKeyRef): get and
    create, never list, watch, update or delete, which would hand it every Secret's
    content or let it rewrite keys it does not own."""
    documents = render(helm, values)
    for role in by_kind(documents, "Role") + by_kind(documents, "ClusterRole"):
        for rule in role["rules"]:
            if "secrets" in rule["resources"]:
                assert rule["verbs"] == ["get", "create"], role["metadata"]["name"]


def test_bad_watch_namespaces_are_refused(helm: str) -> None:
    from .test_helm import run_helm

    result = run_helm(helm, "template", "pagoda", str(CHART), "--set", "watchNamespaces={Team_A}")
    assert result.returncode != 0 and "watchNamespaces" in result.stderr


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_peering_crds_are_valid_and_name_what_the_operator_reads(version: str) -> None:
    crds = {doc["spec"]["names"]["kind"]: doc for doc in load_documents(PEERING_CRDS)}
    assert crds.keys() == {"ClusterKopfPeering", "KopfPeering"}
    for crd in crds.values():
        kubernetes_validate.validate(crd, version, strict=True)
        assert crd["spec"]["group"] == "kopf.dev" and crd["spec"]["versions"][0]["name"] == "v1"
    assert crds["KopfPeering"]["spec"]["scope"] == "Namespaced"
    assert crds["ClusterKopfPeering"]["spec"]["scope"] == "Cluster"


def peer(priority: int, seconds_ago: float, lifetime: int = 60) -> dict[str, Any]:
    seen = NOW - datetime.timedelta(seconds=seconds_ago)
    return {"priority": priority, "lifetime": lifetime, "lastseen": seen.isoformat()}


def test_only_the_highest_live_priority_leads() -> None:
    status = {"me": peer(200, 1), "old": peer(100, 1)}
    assert leads(status, "me", 200, NOW)
    assert not leads(status, "old", 100, NOW)
    # kopf pauses every replica of the highest priority when two share it.
    assert not leads({"me": peer(5, 1), "twin": peer(5, 1)}, "me", 5, NOW)
    # A peer that stopped renewing is dead after its lifetime: the stand-by takes over.
    assert leads({"me": peer(100, 1), "gone": peer(200, 61)}, "me", 100, NOW)
    assert leads(None, "me", 1, NOW)


def test_replicas_started_later_have_higher_priorities() -> None:
    first = parse_run_options(["--peering", "p"], {"POD_ID": "a"})
    second = parse_run_options(["--peering", "p"], {"POD_ID": "b"})
    assert second.priority > first.priority and second.identity == "b"
    standalone = kopf_run_arguments(parse_run_options([], {}))
    assert standalone["standalone"] is True and standalone["priority"] is None


class FakeClient:
    def __init__(self, objects: dict[str, Any]) -> None:
        self.objects = objects
        self.paths: list[str] = []

    async def get(self, path: str) -> Any:
        self.paths.append(path)
        return self.objects.get(path)


def test_the_tuner_lists_only_watched_namespaces_it_leads() -> None:
    now = datetime.datetime.now(datetime.UTC)
    fresh = {"lastseen": now.isoformat(), "lifetime": 60}
    objects = {
        "/apis/kopf.dev/v1/namespaces/a/kopfpeerings/p": {
            "status": {"me": {**fresh, "priority": 9}, "other": {**fresh, "priority": 1}}
        },
        "/apis/kopf.dev/v1/namespaces/b/kopfpeerings/p": {
            "status": {"me": {**fresh, "priority": 9}, "other": {**fresh, "priority": 99}}
        },
        "/apis/pagoda.dev/v1alpha1/namespaces/a/llmdeployments": {"items": [{"n": "a1"}]},
        "/apis/pagoda.dev/v1alpha1/namespaces/b/llmdeployments": {"items": [{"n": "b1"}]},
    }
    client = FakeClient(objects)
    options = RunOptions(namespaces=("a", "b"), peering="p", priority=9, identity="me")
    assert asyncio.run(led_llmdeployments(client, options)) == [{"n": "a1"}]
    assert "/apis/pagoda.dev/v1alpha1/namespaces/b/llmdeployments" not in client.paths
    # Standalone over every namespace: one cluster-wide list, as before.
    client = FakeClient({"/apis/pagoda.dev/v1alpha1/llmdeployments": {"items": [{"n": "x"}]}})
    assert asyncio.run(led_llmdeployments(client, RunOptions())) == [{"n": "x"}]
