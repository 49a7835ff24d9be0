"""The CRD against the API server's own acceptance rules (tests/k8s/apiserver): structural
schema, CEL rules type-checked against the schema's types, CEL cost within the limits."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from .apiserver import crd_problems
from .apiserver.cel_checker import compile_rule
from .apiserver.decl_types import schema_decl_type
from .conftest import CHART, MANIFESTS, load_documents

KEDA_CRDS = sorted((MANIFESTS.parent / "tests" / "k8s" / "data" / "keda").glob("*.yaml"))
SPEC = "spec.versions[0].schema.openAPIV3Schema.properties[spec]"


def minimal_crd(spec_schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "things.example.com"},
        "spec": {
            "group": "example.com",
            "names": {"kind": "Thing", "plural": "things"},
            "scope": "Namespaced",
            "versions": [{
                "name": "v1", "served": True, "storage": True,
                "schema": {"openAPIV3Schema": {
                    "type": "object", "properties": {"spec": spec_schema},
                }},
            }],
        },
    }  # fmt: skip


def messages(spec_schema: dict[str, Any]) -> list[str]:
    return [str(problem) for problem in crd_problems(minimal_crd(spec_schema))]


def rule_on(schema: dict[str, Any], rule: str) -> dict[str, Any]:
    return {**schema, "x-kubernetes-validations": [{"rule": rule}]}


def test_the_shipped_crd_is_accepted(crd: dict[str, Any]) -> None:
    assert [str(problem) for problem in crd_problems(crd)] == []


@pytest.mark.parametrize("path", sorted((CHART / "crds").glob("*.yaml")), ids=lambda p: p.stem)
def test_the_chart_crds_are_accepted(path: Any) -> None:
    """Every CRD the chart installs: ours and the kopf peering CRDs of the operator's HA."""
    for document in load_documents(path):
        assert [str(problem) for problem in crd_problems(document)] == [], document["metadata"]



def test_the_volume_rule_of_commit_6da14f0_is_refused(crd: dict[str, Any]) -> None:
    """Before the fix, volumes.items declared no properties (only preserve-unknown-fields),
    so the API server's CEL could not see `name`: `kubectl apply` of the CRD failed."""
    broken = copy.deepcopy(crd)
    spec = broken["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["volumes"]["items"] = {
        "type": "object",
        "required": ["name"],
        "x-kubernetes-preserve-unknown-fields": True,
        "x-kubernetes-validations": [{
            "rule": "!(self.name in ['model', 'dshm'])",
            "message": "the volume names model and dshm are the operator's",
        }],
    }  # fmt: skip
    errors = [problem for problem in crd_problems(broken) if not problem.lint]
    assert [error.path for error in errors] == [
        f"{SPEC}.properties[volumes].items.x-kubernetes-validations[0].rule"
    ]
    assert "undefined field 'name'" in errors[0].message


@pytest.mark.parametrize("path", KEDA_CRDS, ids=lambda p: p.stem)
def test_crds_real_api_servers_accept_pass(path: Any) -> None:
    """No false alarms on CRDs that clusters run (KEDA's, vendored unchanged)."""
    for document in load_documents(path):
        assert crd_problems(document) == []


OBJECT = {
    "type": "object",
    "properties": {
        "replicas": {"type": "integer"},
        "ratio": {"type": "number"},
        "name": {"type": "string", "maxLength": 63},
        "labels": {"type": "object", "additionalProperties": {"type": "integer"}},
        "when": {"type": "string", "format": "date-time"},
    },
}


@pytest.mark.parametrize(
    ("rule", "error"),
    [
        ("self.missing == 1", "undefined field 'missing'"),
        ("has(self.missing)", "undefined field 'missing'"),
        ("self.replicas + self.ratio > 1.0", "no matching overload for '_+_' applied to '(int, double)'"),
        ("self.replicas == self.ratio", "no matching overload for '_==_' applied to '(int, double)'"),
        ("self.labels.all(k, k > 0)", "no matching overload for '_>_' applied to '(string, int)'"),
        ("self.name.size() == 'a'", "no matching overload for '_==_' applied to '(int, string)'"),
        ("[1, 'a'].size() == 2", "expected type 'int' but found 'string'"),
        ("self.replicas", "cel expression must evaluate to a bool"),
        ("self.name.noSuchFunction()", "no matching overload for 'noSuchFunction'"),
        ("noSuchFunction(self.name)", "undeclared reference to 'noSuchFunction'"),
        ("self.replicas.name == 'a'", "type 'int' does not support field selection"),
    ],
)  # fmt: skip
def test_rules_that_do_not_type_check(rule: str, error: str) -> None:
    (problem,) = messages(rule_on(OBJECT, rule))
    assert error in problem


@pytest.mark.parametrize(
    "rule",
    [
        "self.replicas < self.ratio",  # CrossTypeNumericComparisons (base.go, 1.28+)
        "self.ratio >= 1",
        "self.labels.all(k, self.labels[k] >= 0) && self.labels.exists(k, k == 'a')",
        "self.labels.exists_one(k, k.startsWith('x')) || size(self.labels) == 0",
        "self.name.matches('^[a-z]+$') && self.name.lowerAscii() == self.name",
        "[self.replicas, 2].filter(x, x > 1).map(x, x * 2).all(x, x > 0)",
        "!has(self.name) || self.name in ['a', 'b']",
        "type(self.replicas) == int && self.when < timestamp('2030-01-01T00:00:00Z')",
        "self.name.split('-').size() <= 3 && ['a'].join(',') == 'a'",
    ],
)
def test_rules_that_type_check(rule: str) -> None:
    assert messages(rule_on(OBJECT, rule)) == []


def test_oldself_only_where_the_api_server_correlates_old_and_new() -> None:
    item = rule_on(
        {"type": "object", "required": ["key"], "properties": {"key": {"type": "string"}}},
        "self.key == oldSelf.key",
    )
    plain_list = {"type": "array", "maxItems": 4, "items": item}
    (problem,) = messages({"type": "object", "properties": {"ports": plain_list}})
    assert "oldSelf cannot be used on the uncorrelatable portion of the schema" in problem
    map_list = {
        **plain_list,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["key"],
    }
    assert messages({"type": "object", "properties": {"ports": map_list}}) == []


def test_cost_over_the_limit_on_an_unbounded_list() -> None:
    names = rule_on(
        {"type": "array", "items": {"type": "string"}}, "self.all(x, x.matches('^[a-z]+$'))"
    )
    rule_cost, total_cost = messages({"type": "object", "properties": {"names": names}})
    assert "estimated rule cost exceeds budget by factor of more than 100x" in rule_cost
    assert "total CRD cost exceeds budget" in total_cost
    bounded = {**names, "maxItems": 16, "items": {"type": "string", "maxLength": 63}}
    assert messages({"type": "object", "properties": {"names": bounded}}) == []


def test_a_rule_under_a_list_costs_once_per_item() -> None:
    """getExpressionCost multiplies a rule's cost by the items it may run on."""
    text = {"type": "string", "maxLength": 100_000}
    item = rule_on(text, "self.matches('^[a-z]+$')")
    assert messages({"type": "object", "properties": {"one": item}}) == []
    many = {"type": "array", "maxItems": 1000, "items": item}
    (problem,) = messages({"type": "object", "properties": {"many": many}})
    assert "estimated rule cost exceeds budget" in problem


def test_total_cost_over_the_crd_limit() -> None:
    """Eleven rules under the per-rule limit each add up past StaticEstimatedCRDCostLimit."""
    regex = "^" + "a" * 118 + "$"  # 120 characters: 30 x 314573 (an unbounded string)
    properties = {
        f"s{i}": rule_on({"type": "string"}, f"self.matches('{regex}')") for i in range(11)
    }
    (problem,) = messages({"type": "object", "properties": properties})
    assert problem.startswith("spec.versions[0].schema.openAPIV3Schema: Forbidden: total CRD cost")


def test_cost_matches_cel_go_by_hand() -> None:
    """matches on an unbounded string: ceil((3145726 + 1) x 0.1) x ceil(4 x 0.25) = 314573,
    plus self (1) and the field selection (1)."""
    text = schema_decl_type({"type": "object", "properties": {"s": {"type": "string"}}})
    assert compile_rule("self.s.matches('^a$')", text).max_cost == 314573 + 2


@pytest.mark.parametrize(
    ("schema", "error"),
    [
        ({"type": "object", "properties": {"x": {"description": "no type"}}},
         "properties[x].type: Required value: must not be empty for specified object fields"),
        ({"type": "array"}, "items: Required value: must be specified"),
        ({"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
          "items": {"type": "object", "properties": {"name": {"type": "string"}}}},
         "this property is in x-kubernetes-list-map-keys, so it must have a default or be a required property"),
        ({"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["id"],
          "items": {"type": "object", "properties": {"name": {"type": "string"}}}},
         "entries must all be names of item properties"),
        ({"type": "integer", "minimum": 1, "default": 0}, "default: Invalid value: 0 is less than the minimum of 1"),
        ({"type": "object", "properties": {"a": {"type": "string"}}, "default": {"b": "x"}},
         "default: Invalid value: must not have unknown fields: b"),
        ({"type": "object", "default": {},
          "properties": {"a": {"type": "integer", "default": 5}, "b": {"type": "integer", "default": 1}},
          "x-kubernetes-validations": [{"rule": "self.a <= self.b"}]},
         "default: Invalid value"),
        ({"type": "object", "properties": {"a": {"type": "string"}},
          "anyOf": [{"type": "object", "properties": {"a": {"type": "string"}}}]},
         "anyOf[0].type: Forbidden: must be empty to be structural"),
        ({"type": "object", "required": ["name"], "x-kubernetes-preserve-unknown-fields": True},
         "required field 'name' is not declared in properties"),
    ],
)  # fmt: skip
def test_structural_schema_rules(schema: dict[str, Any], error: str) -> None:
    found = messages(schema)
    assert any(error in message for message in found), found


def test_root_metadata_may_only_restrict_name_and_generate_name() -> None:
    crd = minimal_crd({"type": "object"})
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    root["properties"]["metadata"] = {
        "type": "object",
        "properties": {"labels": {"type": "object"}},
    }
    (problem,) = crd_problems(crd)
    assert "must not specify anything other than name and generateName" in problem.message
    root["properties"]["metadata"] = {"type": "object"}
    root["x-kubernetes-validations"] = [{"rule": "self.metadata.name.size() < 64"}]
    assert crd_problems(crd) == []  # metadata.name is visible to rules at the root
