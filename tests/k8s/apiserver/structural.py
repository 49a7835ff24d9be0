"""Structural-schema rules of one schema node, as kube-apiserver states them.

k8s.io/apiextensions-apiserver/pkg/apiserver/schema/validation.go (validateStructuralInvariants,
validateStructuralMetadataInvariants, validateNestedValueValidation, validateExtensions) and
pkg/apis/apiextensions/validation/validation.go (specStandardValidatorV3.validate, the list-type
and map-type rules, validateMapListKeysMapSet). Messages keep the API server's wording after the
field path; the path is the API server's too (``properties[name]``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

Finding = tuple[str, str, bool]  # path, message, lint
OPENAPI_TYPES = {"string", "number", "integer", "boolean", "array", "object"}
UNSUPPORTED = {
    "id": "id is not supported",
    "additionalItems": "additionalItems is not supported",
    "patternProperties": "patternProperties is not supported",
    "definitions": "definitions is not supported",
    "dependencies": "dependencies is not supported",
    "$ref": "$ref is not supported",
}
# What a schema under anyOf/allOf/oneOf/not must leave to the structural part around it.
NESTED_FORBIDDEN = {
    "type": "must be empty to be structural",
    "default": "must be undefined to be structural",
    "title": "must be empty to be structural",
    "description": "must be empty to be structural",
    "nullable": "must be false to be structural",
    "externalDocs": "must be undefined to be structural",
    "additionalProperties": "must be undefined to be structural",
    "x-kubernetes-preserve-unknown-fields": "must be false to be structural",
    "x-kubernetes-embedded-resource": "must be false to be structural",
    "x-kubernetes-int-or-string": "must be false to be structural",
    "x-kubernetes-list-map-keys": "must be empty to be structural",
    "x-kubernetes-list-type": "must be undefined to be structural",
    "x-kubernetes-map-type": "must be undefined to be structural",
    "x-kubernetes-validations": "must be empty to be structural",
}
EMPTY_TYPE = {
    "root": "must not be empty at the root",
    "item": "must not be empty for specified array items",
    "field": "must not be empty for specified object fields",
}
INT_OR_STRING_ANY_OF = [{"type": "integer"}, {"type": "string"}]


def node_problems(
    schema: dict[str, Any], path: str, level: str, in_metadata: bool
) -> list[Finding]:
    return [
        *_type_problems(schema, path, level),
        *_keyword_problems(schema, path),
        *_root_problems(schema, path, level),
        *_list_and_map_problems(schema, path),
        *_value_validation_problems(schema, path),
        *_required_lint(schema, path),
    ]


def _type_problems(schema: dict[str, Any], path: str, level: str) -> Iterator[Finding]:
    kind = schema.get("type")
    int_or_string = bool(schema.get("x-kubernetes-int-or-string"))
    preserve = schema.get("x-kubernetes-preserve-unknown-fields")
    if schema.get("x-kubernetes-embedded-resource") and kind != "object":
        yield (
            f"{path}.type",
            "Required value: must be object if x-kubernetes-embedded-resource is true",
            False,
        )
    elif not kind and not int_or_string and not preserve:
        yield f"{path}.type", f"Required value: {EMPTY_TYPE[level]}", False
    if kind and kind not in OPENAPI_TYPES:
        yield f"{path}.type", f"Unsupported value: {kind!r}", False
    if kind == "array" and "items" not in schema:
        yield f"{path}.items", "Required value: must be specified", False
    if isinstance(schema.get("items"), list):
        yield f"{path}.items", "Forbidden: items must be a schema object and not an array", False
    if preserve is False:
        yield (
            f"{path}.x-kubernetes-preserve-unknown-fields",
            "Invalid value: must be true or undefined",
            False,
        )
    if int_or_string and preserve:
        yield (
            f"{path}.x-kubernetes-preserve-unknown-fields",
            "Invalid value: must be false if x-kubernetes-int-or-string is true",
            False,
        )
    extra = schema.get("additionalProperties")
    if schema.get("properties") and (extra is False or isinstance(extra, dict)):
        yield (
            f"{path}.additionalProperties",
            "Forbidden: additionalProperties and properties are mutual exclusive",
            False,
        )


def _keyword_problems(schema: dict[str, Any], path: str) -> Iterator[Finding]:
    for keyword, message in UNSUPPORTED.items():
        if keyword in schema:
            yield f"{path}.{keyword}", f"Forbidden: {message}", False
    pattern = schema.get("pattern")
    if pattern is not None:
        try:
            re.compile(pattern)  # Go's RE2 is stricter (no lookaround, no backreferences)
        except re.error as error:
            yield (
                f"{path}.pattern",
                f"Invalid value: must be a valid regular expression, but isn't: {error}",
                False,
            )


def _root_problems(schema: dict[str, Any], path: str, level: str) -> Iterator[Finding]:
    check_metadata = level == "root" or schema.get("x-kubernetes-embedded-resource")
    if not check_metadata:
        return
    properties = schema.get("properties") or {}
    if level == "root":
        if schema.get("type") not in (None, "object"):
            yield f"{path}.type", "Invalid value: must be object at the root", False
        if "additionalProperties" in schema:
            yield f"{path}.additionalProperties", "Forbidden: must not be used at the root", False
    for name in ("kind", "apiVersion"):
        if name in properties and properties[name].get("type") != "string":
            yield f"{path}.properties[{name}].type", "Invalid value: must be string", False
    metadata = properties.get("metadata")
    if metadata is None:
        return
    if metadata.get("type") != "object":
        yield f"{path}.properties[metadata].type", "Invalid value: must be object", False
    if level != "root":
        return
    rest = {k: v for k, v in metadata.items() if k not in ("type", "default", "properties")}
    names = set(metadata.get("properties") or {})
    if rest or not names <= {"name", "generateName"}:
        yield (f"{path}.properties[metadata]", "Forbidden: must not specify anything other than "
               "name and generateName, but metadata is implicitly specified", False)  # fmt: skip


def _list_and_map_problems(schema: dict[str, Any], path: str) -> Iterator[Finding]:
    list_type = schema.get("x-kubernetes-list-type")
    keys = schema.get("x-kubernetes-list-map-keys") or []
    map_type = schema.get("x-kubernetes-map-type")
    if map_type is not None and schema.get("type") != "object":
        yield (
            f"{path}.type",
            "Invalid value: must be object if x-kubernetes-map-type is specified",
            False,
        )
    if map_type not in (None, "atomic", "granular"):
        yield f"{path}.x-kubernetes-map-type", f"Unsupported value: {map_type!r}", False
    if list_type is not None and schema.get("type") != "array":
        yield (
            f"{path}.type",
            "Invalid value: must be array if x-kubernetes-list-type is specified",
            False,
        )
    if list_type not in (None, "atomic", "set", "map"):
        yield f"{path}.x-kubernetes-list-type", f"Unsupported value: {list_type!r}", False
    if keys and list_type != "map":
        yield (
            f"{path}.x-kubernetes-list-type",
            "Invalid value: must be map if x-kubernetes-list-map-keys is non-empty",
            False,
        )
    if list_type != "map":
        return
    if not keys:
        yield (
            f"{path}.x-kubernetes-list-map-keys",
            "Required value: must not be empty if x-kubernetes-list-type is map",
            False,
        )
    items = schema.get("items") if isinstance(schema.get("items"), dict) else {}
    if items.get("type") != "object":
        yield (
            f"{path}.items.type",
            "Invalid value: must be object if parent array's x-kubernetes-list-type is map",
            False,
        )
        return
    required = set(items.get("required") or [])
    for key in keys:
        prop = (items.get("properties") or {}).get(key)
        where = f"{path}.items.properties[{key}]"
        if prop is None:
            yield (
                f"{path}.x-kubernetes-list-map-keys",
                "Invalid value: entries must all be names of item properties",
                False,
            )
            continue
        if prop.get("type") in ("array", "object"):
            yield (
                f"{where}.type",
                "Invalid value: must be a scalar type if parent array's x-kubernetes-list-type is map",
                False,
            )
        if key not in required and "default" not in prop:
            yield (f"{where}.default", "Required value: this property is in x-kubernetes-list-map-keys, "
                   "so it must have a default or be a required property", False)  # fmt: skip
        if prop.get("nullable"):
            yield (
                f"{where}.nullable",
                "Forbidden: this property is in x-kubernetes-list-map-keys, so it cannot be nullable",
                False,
            )
    if len(set(keys)) != len(keys):
        yield (
            f"{path}.x-kubernetes-list-map-keys",
            "Invalid value: must not contain duplicate entries",
            False,
        )


def _is_int_or_string_pattern(schema: dict[str, Any]) -> bool:
    return schema.get("anyOf") == INT_OR_STRING_ANY_OF


def _value_validation_problems(schema: dict[str, Any], path: str) -> Iterator[Finding]:
    skip_any_of = _is_int_or_string_pattern(schema)
    for junctor in ("anyOf", "allOf", "oneOf"):
        if junctor == "anyOf" and skip_any_of:
            continue
        for index, nested in enumerate(schema.get(junctor) or []):
            skip_type = junctor == "allOf" and index == 0 and _is_int_or_string_pattern(nested)
            yield from _nested_problems(nested, schema, f"{path}.{junctor}[{index}]", skip_type)
    if isinstance(schema.get("not"), dict):
        yield from _nested_problems(schema["not"], schema, f"{path}.not", False)


def _nested_problems(
    nested: dict[str, Any], outer: dict[str, Any], path: str, skip_any_of: bool
) -> Iterator[Finding]:
    for keyword, message in NESTED_FORBIDDEN.items():
        if keyword in nested and not (keyword == "nullable" and nested[keyword] is False):
            yield f"{path}.{keyword}", f"Forbidden: {message}", False
    properties = nested.get("properties") or {}
    if "metadata" in properties:
        yield (
            f"{path}.properties[metadata]",
            "Forbidden: must not be specified in a nested context",
            False,
        )
    for name, sub in properties.items():
        # validateStructuralCompleteness: what value validation names, the schema declares
        if name not in (outer.get("properties") or {}):
            yield (
                f"{path}.properties[{name}]",
                "Required value: must not be specified in a nested context without the structural schema declaring it",
                False,
            )
        yield from _nested_problems(
            sub, (outer.get("properties") or {}).get(name, {}), f"{path}.properties[{name}]", False
        )
    if isinstance(nested.get("items"), dict):
        yield from _nested_problems(
            nested["items"], outer.get("items") or {}, f"{path}.items", False
        )
    for junctor in ("anyOf", "allOf", "oneOf"):
        if junctor == "anyOf" and skip_any_of:
            continue
        for index, inner in enumerate(nested.get(junctor) or []):
            yield from _nested_problems(inner, outer, f"{path}.{junctor}[{index}]", False)


def _required_lint(schema: dict[str, Any], path: str) -> Iterator[Finding]:
    """Accepted by the API server, but a rule cannot see an undeclared field ("undefined field")
    and, without x-kubernetes-preserve-unknown-fields, pruning drops it before `required` runs."""
    declared = set(schema.get("properties") or {})
    if isinstance(schema.get("additionalProperties"), dict):
        return
    for name in schema.get("required") or []:
        if name not in declared:
            yield (f"{path}.required", f"required field {name!r} is not declared in properties: "
                   "declare it so CEL rules and pruning see it", True)  # fmt: skip
