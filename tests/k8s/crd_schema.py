"""Validate objects against a CRD the way the API server does, without an API server.

Three steps, in the API server's order: apply the schema's defaults, check the structural
schema (as JSON Schema, with kubectl's strict rejection of unknown fields), then evaluate
the CEL rules (``x-kubernetes-validations``) with cel-python.
"""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

import celpy
import jsonschema


def version_schema(crd: dict[str, Any], version: str = "v1alpha1") -> dict[str, Any]:
    entry = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    return entry["schema"]["openAPIV3Schema"]


def to_json_schema(node: Any) -> Any:
    """OpenAPI v3.0 (Kubernetes flavour) to JSON Schema draft 2020-12."""
    if isinstance(node, list):
        return [to_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    result = {
        key: to_json_schema(value)
        for key, value in node.items()
        if not key.startswith("x-kubernetes-")
        and key not in ("exclusiveMinimum", "exclusiveMaximum")
    }
    if node.get("exclusiveMinimum") is True:
        result["exclusiveMinimum"] = result.pop("minimum")
    if node.get("exclusiveMaximum") is True:
        result["exclusiveMaximum"] = result.pop("maximum")
    if "properties" in node:
        result["properties"] = {k: to_json_schema(v) for k, v in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            result.setdefault("additionalProperties", False)
    if (
        node.get("type") == "object"
        and "properties" not in node
        and "additionalProperties" not in node
    ):
        result.pop("additionalProperties", None)
    return result


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """``value`` with the schema's defaults filled in, recursively (a copy)."""
    value = copy.deepcopy(value)
    if isinstance(value, dict):
        for key, sub_schema in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub_schema:
                value[key] = copy.deepcopy(sub_schema["default"])
            if key in value:
                value[key] = apply_defaults(sub_schema, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in set(value) - set(schema.get("properties") or {}):
                value[key] = apply_defaults(extra, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [apply_defaults(schema["items"], item) for item in value]
    return value


@cache
def _compiled(rule: str) -> Any:
    environment = celpy.Environment()
    return environment.program(environment.compile(rule))


# Compile once at import: the CEL parser raises the recursion limit on first use, which
# hypothesis warns about when it happens inside a property test.
_compiled("true")


def cel_errors(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Messages of the CEL rules ``value`` breaks, each prefixed with where the rule sits."""
    errors = []
    for validation in schema.get("x-kubernetes-validations") or []:
        result = _compiled(validation["rule"]).evaluate({"self": celpy.json_to_cel(value)})
        if not bool(result) or isinstance(result, celpy.CELEvalError):
            errors.append(f"{path or '<root>'}: {validation.get('message', validation['rule'])}")
    if isinstance(value, dict):
        for key, sub_schema in (schema.get("properties") or {}).items():
            if key in value:
                errors += cel_errors(sub_schema, value[key], f"{path}.{key}" if path else key)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            errors += cel_errors(schema["items"], item, f"{path}[{index}]")
    return errors


def list_type_errors(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Duplicates in ``x-kubernetes-list-type: map`` (by the list-map keys) and ``set`` lists,
    refused with "Duplicate value" as the API server's listtype validation does
    (apiextensions-apiserver, pkg/apiserver/schema/listtype/validation.go)."""
    errors = []
    if isinstance(value, dict):
        for key, sub_schema in (schema.get("properties") or {}).items():
            if key in value:
                where = f"{path}.{key}" if path else key
                errors += list_type_errors(sub_schema, value[key], where)
    elif isinstance(value, list):
        list_type = schema.get("x-kubernetes-list-type")
        keys = schema.get("x-kubernetes-list-map-keys") or []
        seen: list[Any] = []
        for index, item in enumerate(value):
            identity = [item.get(k) for k in keys] if list_type == "map" else item
            if list_type in ("map", "set") and identity in seen:
                errors.append(f"{path}[{index}]: Duplicate value: {identity}")
            seen.append(identity)
            if isinstance(schema.get("items"), dict):
                errors += list_type_errors(schema["items"], item, f"{path}[{index}]")
    return errors


def validation_errors(
    crd: dict[str, Any], obj: dict[str, Any], version: str = "v1alpha1"
) -> list[str]:
    """Every reason the API server would refuse ``obj``; empty when it would accept it."""
    schema = version_schema(crd, version)
    defaulted = apply_defaults(schema, obj)
    validator = jsonschema.Draft202012Validator(to_json_schema(schema))
    errors = [
        f"{'.'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
        for error in validator.iter_errors(defaulted)
    ]
    errors += list_type_errors(schema, defaulted)
    if errors:
        return errors  # CEL runs only on objects that pass the structural schema
    return cel_errors(schema, defaulted)
