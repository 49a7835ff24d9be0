"""Walk a CRD's schemas as kube-apiserver validates them on create and update.

Follows k8s.io/apiextensions-apiserver:
- pkg/apis/apiextensions/validation/validation.go, ValidateCustomResourceDefinitionOpenAPISchema:
  list/map types and keys, x-kubernetes-validations fields, which parts of the schema are
  uncorrelatable for oldSelf, the per-rule (StaticEstimatedCostLimit) and per-CRD
  (StaticEstimatedCRDCostLimit) cost limits with the rule cost multiplied by its cardinality
  (getExpressionCost), and CEL compiled only where the schema has no errors at or below;
- pkg/apiserver/schema/validation.go, ValidateStructural (see structural.py);
- pkg/apiserver/schema/defaulting/validation.go: defaults validate, CEL rules included, and
  survive pruning.
Problems flagged ``lint`` are accepted by the API server but break a rule or a field.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .cel_checker import compile_rule
from .decl_types import MAX_REQUEST_SIZE_BYTES, schema_decl_type
from .defaults import default_problems
from .structural import node_problems

STATIC_ESTIMATED_COST_LIMIT = 10_000_000
STATIC_ESTIMATED_CRD_COST_LIMIT = 100_000_000
SUPPORTED_REASONS = {
    "FieldValueRequired", "FieldValueForbidden", "FieldValueInvalid", "FieldValueDuplicate",
}  # fmt: skip


@dataclass(frozen=True)
class Problem:
    path: str
    message: str
    lint: bool = False

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" + (" (lint)" if self.lint else "")


@dataclass(frozen=True)
class Context:
    level: str = "root"  # root, item or field: which "type must not be empty" message applies
    cardinality: int | None = 1  # times a rule here may run per object; None: unbounded
    uncorrelatable: str | None = None  # where oldSelf stops being usable
    in_metadata: bool = False


def crd_problems(crd: dict[str, Any]) -> list[Problem]:
    """Every reason kube-apiserver would refuse ``crd``, and the lint findings."""
    problems: list[Problem] = []
    for index, version in enumerate(crd["spec"]["versions"]):
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        path = f"spec.versions[{index}].schema.openAPIV3Schema"
        if schema is None:
            problems.append(Problem(path, "Required value: schemas are required"))
            continue
        walker = SchemaWalker()
        walker.walk(schema, path, Context())
        problems += walker.problems
        if walker.total_cost > STATIC_ESTIMATED_CRD_COST_LIMIT:
            message = cost_message("total CRD cost", walker.total_cost,
                                   STATIC_ESTIMATED_CRD_COST_LIMIT)  # fmt: skip
            problems.append(Problem(path, f"Forbidden: {message}"))
    return problems


def cost_message(name: str, cost: int, limit: int) -> str:
    """getCostErrorMessage's wording."""
    factor = cost / limit
    shown = (
        "more than 100x" if factor > 100 else f"{factor:f}x" if factor < 1.5 else f"{factor:.1f}x"
    )
    return (
        f"{name} exceeds budget by factor of {shown} (try simplifying the rule, or adding "
        "maxItems, maxProperties, and maxLength where arrays, maps, and strings are declared)"
    )


def _times(cardinality: int | None, bound: Any) -> int | None:
    if cardinality is None or bound is None:
        return None
    return cardinality * max(0, int(bound))


class SchemaWalker:
    def __init__(self) -> None:
        self.problems: list[Problem] = []
        self.total_cost = 0

    def report(self, path: str, message: str, lint: bool = False) -> None:
        self.problems.append(Problem(path, message, lint))

    def errors_since(self, start: int) -> bool:
        return any(not problem.lint for problem in self.problems[start:])

    def walk(self, schema: dict[str, Any], path: str, ctx: Context) -> None:
        start = len(self.problems)
        for where, message, lint in node_problems(schema, path, ctx.level, ctx.in_metadata):
            self.report(where, message, lint)
        self.walk_children(schema, path, ctx)
        if "default" in schema:
            for where, message in default_problems(schema, path, ctx.in_metadata):
                self.report(where, message)
        if schema.get("x-kubernetes-validations") and not self.errors_since(start):
            self.check_rules(schema, path, ctx)

    def walk_children(self, schema: dict[str, Any], path: str, ctx: Context) -> None:
        items = schema.get("items")
        if isinstance(items, dict):
            uncorrelatable = ctx.uncorrelatable
            if schema.get("x-kubernetes-list-type") != "map":
                uncorrelatable = uncorrelatable or path  # only map lists correlate items
            child = replace(ctx, level="item", uncorrelatable=uncorrelatable,
                            cardinality=_times(ctx.cardinality, schema.get("maxItems")))  # fmt: skip
            self.walk(items, f"{path}.items", child)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            child = replace(ctx, level="field",
                            cardinality=_times(ctx.cardinality, schema.get("maxProperties")))  # fmt: skip
            self.walk(extra, f"{path}.additionalProperties", child)
        for name, prop in (schema.get("properties") or {}).items():
            child = replace(ctx, level="field")
            if schema.get("x-kubernetes-map-type") == "atomic":
                child = replace(child, uncorrelatable=ctx.uncorrelatable or path)
            if ctx.level == "root" and name == "metadata":
                child = replace(child, in_metadata=True)
            self.walk(prop, f"{path}.properties[{name}]", child)

    def check_rules(self, schema: dict[str, Any], path: str, ctx: Context) -> None:
        is_root = ctx.level == "root" or bool(schema.get("x-kubernetes-embedded-resource"))
        self_type = schema_decl_type(schema, is_root)
        rules_path = f"{path}.x-kubernetes-validations"
        if self_type is None:
            self.report(rules_path, "rule declared on schema that does not support validation "
                        f"rules type: '{schema.get('type', '')}'")  # fmt: skip
            return
        cardinality = ctx.cardinality
        if cardinality is None:  # under an unbounded list or map: celmodel.MaxCardinality
            cardinality = MAX_REQUEST_SIZE_BYTES // (self_type.min_size + 1)
        for index, rule in enumerate(schema["x-kubernetes-validations"]):
            where = f"{rules_path}[{index}]"
            if not self.rule_fields_valid(rule, where):
                continue
            compiled = compile_rule(rule["rule"], self_type)
            cost = compiled.max_cost * cardinality
            if cost > STATIC_ESTIMATED_COST_LIMIT:
                message = cost_message("estimated rule cost", cost, STATIC_ESTIMATED_COST_LIMIT)
                self.report(f"{where}.rule", f"Forbidden: {message}")
            self.total_cost += cost
            if compiled.error:
                self.report(f"{where}.rule", f"Invalid value: {compiled.error}")
            elif compiled.uses_old_self and ctx.uncorrelatable:
                self.report(f"{where}.rule", "Invalid value: oldSelf cannot be used on the "
                            f"uncorrelatable portion of the schema within {ctx.uncorrelatable}")  # fmt: skip
            elif not compiled.uses_old_self and "optionalOldSelf" in rule:
                self.report(f"{where}.optionalOldSelf",
                            "Invalid value: may not be set if oldSelf is not used in rule")  # fmt: skip

    def rule_fields_valid(self, rule: dict[str, Any], where: str) -> bool:
        text = (rule.get("rule") or "").strip()
        message = rule.get("message")
        if not text:
            self.report(f"{where}.rule", "Required value: rule is not specified")
            return False
        if message is not None and not message.strip():
            self.report(f"{where}.message", "Invalid value: message must be non-empty if specified")
        elif message and any(c in message.strip() for c in "\r\n"):
            self.report(f"{where}.message", "Invalid value: message must not contain line breaks")
        elif any(c in text for c in "\r\n") and not (message or "").strip():
            self.report(f"{where}.message",
                        "Required value: message must be specified if rule contains line breaks")  # fmt: skip
        if "reason" in rule and rule["reason"] not in SUPPORTED_REASONS:
            self.report(f"{where}.reason", f"Unsupported value: {rule['reason']!r}")
        return True
