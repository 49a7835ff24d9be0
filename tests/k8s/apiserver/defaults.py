"""Defaults as kube-apiserver accepts them in a CRD schema.

k8s.io/apiextensions-apiserver/pkg/apiserver/schema/defaulting/validation.go: a default is
defaulted itself (nested defaults filled in), must validate against its schema, CEL rules
included, and must be unchanged by pruning (no field the schema would drop); validation.go
forbids defaults in the top-level metadata.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jsonschema

from ..crd_schema import apply_defaults, cel_errors, to_json_schema


def default_problems(schema: dict[str, Any], path: str, in_metadata: bool) -> list[tuple[str, str]]:
    where = f"{path}.default"
    if in_metadata:
        return [(where, "Forbidden: must not be set in top-level metadata")]
    value = apply_defaults(schema, schema["default"])
    problems = [(where, f"Invalid value: must not have unknown fields: {field}")
                for field in unpruned_fields(schema, value)]  # fmt: skip
    validator = jsonschema.Draft202012Validator(to_json_schema(schema))
    problems += [
        (where, f"Invalid value: {error.message}") for error in validator.iter_errors(value)
    ]
    if not problems:
        problems += [(where, f"Invalid value: {error}") for error in cel_errors(schema, value)]
    return problems


def unpruned_fields(schema: dict[str, Any], value: Any, at: str = "") -> Iterator[str]:
    """Fields of ``value`` that pruning would drop: undeclared, outside preserve-unknown-fields."""
    if schema.get("x-kubernetes-preserve-unknown-fields") or schema.get(
        "x-kubernetes-embedded-resource"
    ):
        return
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if key in properties:
                yield from unpruned_fields(properties[key], item, f"{at}.{key}")
            elif isinstance(extra, dict):
                yield from unpruned_fields(extra, item, f"{at}.{key}")
            elif extra is not True:
                yield f"{at}.{key}" if at else key
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            yield from unpruned_fields(schema["items"], item, f"{at}[{index}]")
