"""The Helm chart: lints and renders with default and full values into valid manifests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pagoda_operator.desired import MonitorSettings, desired_objects, desired_service_monitor

from .conftest import CHART, MANIFESTS, REPO_ROOT, load_documents
from .test_manifests import KUBERNETES_VERSIONS

GEN_CRD = REPO_ROOT / "scripts" / "gen-crd.py"
FULL_VALUES = Path(__file__).parent / "data" / "values-full.yaml"
VALUE_SETS = {"default": [], "full": ["-f", str(FULL_VALUES)]}
# Kinds that come from CRDs the validator cannot know; checked by hand below.
CUSTOM_KINDS = {"ServiceMonitor", "ClusterKopfPeering", "KopfPeering"}


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)


def render(helm: str, values: list[str], *flags: str) -> list[dict[str, Any]]:
    result = run_helm(
        helm, "template", "pagoda", str(CHART), "-n", "pagoda-system", *flags, *values
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(documents: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in documents if doc["kind"] == kind]


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request: pytest.FixtureRequest, helm: str) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(helm, VALUE_SETS[request.param])


@pytest.mark.parametrize("values", sorted(VALUE_SETS))
def test_helm_lint(helm: str, values: str) -> None:
    result = run_helm(helm, "lint", "--strict", str(CHART), *VALUE_SETS[values])
    assert result.returncode == 0, result.stdout + result.stderr


def test_values_schema_rejects_bad_values(helm: str) -> None:
    result = run_helm(helm, "template", "pagoda", str(CHART), "--set", "livenessPort=80")
    assert result.returncode != 0
    assert "livenessPort" in result.stderr
    result = run_helm(helm, "template", "pagoda", str(CHART), "--set", "rbac.craete=true")
    assert result.returncode != 0
    assert "craete" in result.stderr


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_rendered_manifests_validate(rendered: tuple[str, list], version: str) -> None:
    _, documents = rendered
    for document in documents:
        if document["kind"] in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(document, version, strict=True)


def test_crd_comes_from_crds_and_matches_the_plain_manifest(
    helm: str, rendered: tuple[str, list]
) -> None:
    """The CRD is plain YAML in crds/ (Helm installs it first, never upgrades or deletes it):
    no template renders it, and `--include-crds` (what `helm install` applies) adds it."""
    name, documents = rendered
    assert by_kind(documents, "CustomResourceDefinition") == []
    with_crds = render(helm, VALUE_SETS[name], "--include-crds")
    crds = {d["metadata"]["name"]: d for d in by_kind(with_crds, "CustomResourceDefinition")}
    assert crds["llmdeployments.pagoda.dev"] == load_documents(MANIFESTS / "crd.yaml")[0]


def test_generated_crd_copies_are_current() -> None:
    result = subprocess.run(
        [sys.executable, str(GEN_CRD), "--check"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_rbac_matches_the_plain_manifest(rendered: tuple[str, list]) -> None:
    _, documents = rendered
    roles = {doc["metadata"]["name"]: doc for doc in by_kind(documents, "ClusterRole")}
    plain = {
        doc["metadata"]["name"].removeprefix("pagoda-operator"): doc
        for doc in load_documents(MANIFESTS / "rbac.yaml")
        if doc["kind"] == "ClusterRole"
    }
    rendered_roles = {
        name.removeprefix("pagoda-pagoda-operator"): role for name, role in roles.items()
    }
    # -peering: kopf's peering object, which the plain manifests' lone replica does not use.
    peering = rendered_roles.pop("-peering")
    assert peering["rules"][0]["resources"] == ["clusterkopfpeerings"]
    assert rendered_roles.keys() == {"", "-llmdeployments-view", "-llmdeployments-edit"}
    plain = {
        key.replace("pagoda-", "-", 1) if key.startswith("pagoda-") else key: doc
        for key, doc in plain.items()
    }
    for suffix, role in rendered_roles.items():
        assert role["rules"] == plain[suffix]["rules"], suffix
    # Namespace users reach LLMDeployments through the built-in roles.
    labels = rendered_roles["-llmdeployments-edit"]["metadata"]["labels"]
    assert labels["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    (account,) = by_kind(documents, "ServiceAccount")
    for binding in by_kind(documents, "ClusterRoleBinding"):
        assert binding["subjects"][0]["name"] == account["metadata"]["name"]


def test_operator_deployment(rendered: tuple[str, list]) -> None:
    name, documents = rendered
    (deployment,) = by_kind(documents, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    env = {item["name"]: item.get("value") for item in container["env"]}
    if name == "full":
        assert container["image"] == "registry.example.com/pagoda/pagoda-operator:0.1.0-rc1"
        assert env["PAGODA_SERVICE_MONITORS"] == "false"
        assert env["PAGODA_LIVENESS_ENDPOINT"] == "http://0.0.0.0:9090/healthz"
    else:
        assert container["image"] == "ghcr.io/pagoda-dev/pagoda-operator:0.1.0"
        assert env["PAGODA_SERVICE_MONITORS"] == "true"


def test_service_monitor_only_when_enabled(rendered: tuple[str, list]) -> None:
    name, documents = rendered
    monitors = by_kind(documents, "ServiceMonitor")
    if name == "default":
        assert monitors == []
        return
    (monitor,) = monitors
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("http", "/metrics", "30s")
    assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "pagoda-engine"


def test_every_service_monitor_labels_series_as_the_tuner_selects_them(helm: str) -> None:
    """The chart's ServiceMonitor and the operator's per-LLMDeployment ones relabel alike
    (without `llmdeployment` the tuner finds no series), and both carry the labels a
    kube-prometheus-stack Prometheus selects ServiceMonitors by."""
    labels = ["--set", "serviceMonitor.labels.release=kube-prometheus-stack"]
    chart_level = render(helm, ["--set", "serviceMonitor.enabled=true", *labels])
    (monitor,) = by_kind(chart_level, "ServiceMonitor")
    llmd = {"metadata": {"name": "qwen2-5-7b", "namespace": "team-a", "uid": "u"}, "spec": {}}
    per_object = render(helm, labels)
    (deployment,) = by_kind(per_object, "Deployment")
    env = container_env(deployment)
    assert env["PAGODA_SERVICE_MONITORS"] == "true"
    settings = MonitorSettings(
        labels=json.loads(env["PAGODA_SERVICE_MONITOR_LABELS"]),
        interval=env["PAGODA_SERVICE_MONITOR_INTERVAL"],
    )
    own = desired_service_monitor(llmd, settings)
    assert own["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert own["metadata"]["labels"]["pagoda.dev/llmdeployment"] == "qwen2-5-7b"
    assert own["spec"]["endpoints"][0]["interval"] == "15s"
    relabelings = own["spec"]["endpoints"][0]["relabelings"]
    assert monitor["spec"]["endpoints"][0]["relabelings"] == relabelings
    assert relabelings == [
        {
            "sourceLabels": ["__meta_kubernetes_pod_label_pagoda_dev_llmdeployment"],
            "targetLabel": "llmdeployment",
        }
    ]
    # The chart's own ServiceMonitor replaces the per-object ones: never both.
    assert (
        container_env(by_kind(chart_level, "Deployment")[0])["PAGODA_SERVICE_MONITORS"] == "false"
    )


def container_env(deployment: dict[str, Any]) -> dict[str, str]:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {item["name"]: item.get("value") for item in container["env"]}


def test_helm_test_hook_calls_v1_models(rendered: tuple[str, list]) -> None:
    name, documents = rendered
    (pod,) = by_kind(documents, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    url = pod["spec"]["containers"][0]["args"][-1]
    expected = "qwen2-5-7b.inference" if name == "full" else "smollm2.default"
    assert url == f"http://{expected}.svc:8000/v1/models"


def test_values_accept_global_as_a_subchart_gets_it(helm: str) -> None:
    """A parent chart passes `global` to every subchart: the schema must let it through,
    while still refusing typos in this chart's own keys."""
    for command in ("template", "lint"):
        name = ["pagoda"] if command == "template" else []
        result = run_helm(helm, command, *name, str(CHART), "--set", "global.foo=bar")
        assert result.returncode == 0, result.stdout + result.stderr
    result = run_helm(helm, "template", "pagoda", str(CHART), "--set", "imagee.tag=x")
    assert result.returncode != 0 and "imagee" in result.stderr


def blocking_owner_kinds() -> set[tuple[str, str]]:
    """(API group, kind) of every owner the operator's objects name with blockOwnerDeletion,
    over samples that between them create every kind of owned object."""
    owners = set()
    for path in sorted((MANIFESTS / "samples").glob("*.yaml")):
        (llmd,) = load_documents(path)
        llmd["metadata"]["uid"] = "uid-1"
        for obj in desired_objects(llmd, service_monitor_api=True):
            for ref in obj["metadata"].get("ownerReferences") or []:
                if ref.get("blockOwnerDeletion"):
                    owners.add((ref["apiVersion"].rpartition("/")[0], ref["kind"]))
    return owners


def test_every_blocking_owner_reference_has_its_finalizers_permission(
    rendered: tuple[str, list],
) -> None:
    """Kubernetes' OwnerReferencesPermissionEnforcement admission plugin (on in OpenShift)
    refuses an ownerReference with blockOwnerDeletion: true unless the client may `update`
    the owner's `finalizers` subresource (plugin/pkg/admission/gc/gc_admission.go)."""
    crd = load_documents(MANIFESTS / "crd.yaml")[0]
    plurals = {(crd["spec"]["group"], crd["spec"]["names"]["kind"]): crd["spec"]["names"]["plural"]}
    owners = blocking_owner_kinds()
    assert owners, "the operator sets blockOwnerDeletion on its objects"
    _, documents = rendered
    plain = [doc for doc in load_documents(MANIFESTS / "rbac.yaml") if doc["kind"] == "ClusterRole"]
    operator_roles = [
        role for role in [*by_kind(documents, "ClusterRole"), *plain]
        if role["metadata"]["name"] in ("pagoda-pagoda-operator", "pagoda-operator")
    ]  # fmt: skip
    assert len(operator_roles) == 2
    for role in operator_roles:
        for group, kind in owners:
            assert (group, kind) in plurals, f"no plural known for owner kind {kind}"
            resource = f"{plurals[group, kind]}/finalizers"
            assert any(
                group in rule["apiGroups"] and resource in rule["resources"]
                and "update" in rule["verbs"]
                for rule in role["rules"]
            ), f"{role['metadata']['name']}: no update on {group} {resource}"  # fmt: skip
