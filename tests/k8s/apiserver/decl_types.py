"""CEL types of a structural schema, as the API server derives them.

Follows k8s.io/apiserver/pkg/cel/common/schemas.go (SchemaDeclType, WithTypeAndObjectMeta and
the estimate* helpers) and pkg/cel/limits.go: every object is a CEL object type whose fields are
the declared properties only (x-kubernetes-preserve-unknown-fields hides nothing more from the
schema and adds nothing to CEL), maps and lists carry their element types, and every string,
list and map carries the largest size the cost estimator assumes for it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# limits.go: DefaultMaxRequestSizeBytes (3 MiB) and the JSON sizes of scalars.
MAX_REQUEST_SIZE_BYTES = 3 * 1024 * 1024
MIN_STRING_SIZE = 2  # ""
MIN_BOOL_SIZE = 4  # true
MIN_NUMBER_SIZE = 1  # 0
MAX_DATETIME_SIZE_JSON = 32
MIN_DATETIME_SIZE_JSON = 21
JSON_DATE_SIZE = 12
MAX_DURATION_SIZE_JSON = 32
MIN_DURATION_SIZE_JSON = 3

# CEL reserved words that apiservercel.Escape wraps as __word__ (cel-spec: reserved identifiers).
_CEL_RESERVED = {
    "true", "false", "null", "in", "as", "break", "const", "continue", "else", "for",
    "function", "if", "import", "let", "loop", "package", "namespace", "return", "var",
    "void", "while",
}  # fmt: skip
_IDENTIFIER = re.compile(r"^[_a-zA-Z][_a-zA-Z0-9]*$")


@dataclass(eq=False)
class DeclType:
    """A CEL type: name is one of object, map, list, string, bytes, int, uint, double, bool,
    dyn, null_type, timestamp, duration, type, or an opaque library type (URL, Quantity)."""

    name: str
    fields: dict[str, DeclField] = field(default_factory=dict)
    elem: DeclType | None = None  # list element or map value
    key: DeclType | None = None  # map key
    max_elements: int = 0  # size bound: bytes of a string, items of a list, entries of a map
    min_size: int = 0  # smallest JSON serialization

    def __str__(self) -> str:
        if self.name == "list":
            return f"list({self.elem})"
        if self.name == "map":
            return f"map({self.key}, {self.elem})"
        return self.name


@dataclass
class DeclField:
    type: DeclType
    required: bool
    has_default: bool


def simple(name: str, min_size: int = MIN_NUMBER_SIZE) -> DeclType:
    return DeclType(name, min_size=min_size)


def list_of(elem: DeclType, max_items: int) -> DeclType:
    return DeclType("list", elem=elem, max_elements=max_items)


def map_of(key: DeclType, value: DeclType, max_entries: int) -> DeclType:
    return DeclType("map", key=key, elem=value, max_elements=max_entries)


def escape(name: str) -> str | None:
    """apiservercel.Escape: the CEL name of a property, or None when CEL cannot name it."""
    if name in _CEL_RESERVED:
        return f"__{name}__"
    escaped = (
        name.replace("__", "__underscores__")
        .replace(".", "__dot__")
        .replace("-", "__dash__")
        .replace("/", "__slash__")
    )
    return escaped if _IDENTIFIER.match(escaped) else None


def with_type_and_object_meta(schema: dict[str, Any]) -> dict[str, Any]:
    """At a resource root apiVersion, kind, metadata.name and metadata.generateName are always
    visible to rules, whatever the schema declares of metadata (WithTypeAndObjectMeta)."""
    properties = dict(schema.get("properties") or {})
    properties["kind"] = {"type": "string"}
    properties["apiVersion"] = {"type": "string"}
    properties["metadata"] = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "generateName": {"type": "string"}},
    }
    return {**schema, "properties": properties}


def _string_max_elements(schema: dict[str, Any]) -> int:
    # estimateMaxElementsFromMaxLength: maxLength counts code points, the estimator bytes (x4).
    if "maxLength" in schema:
        return max(0, int(schema["maxLength"])) * 4
    if schema.get("enum") and schema.get("type") == "string":
        return max(len(str(value)) for value in schema["enum"])  # estimateMaxStringEnumLength
    return MAX_REQUEST_SIZE_BYTES - 2  # estimateMaxStringLengthPerRequest


def _string_type(schema: dict[str, Any]) -> DeclType:
    fmt = schema.get("format")
    if fmt == "byte":
        return DeclType("bytes", max_elements=_string_max_elements(schema), min_size=2)
    if fmt == "duration":
        return DeclType("duration", max_elements=MAX_DURATION_SIZE_JSON, min_size=3)
    if fmt == "date":
        return DeclType("timestamp", max_elements=JSON_DATE_SIZE, min_size=JSON_DATE_SIZE)
    if fmt == "date-time":
        return DeclType(
            "timestamp", max_elements=MAX_DATETIME_SIZE_JSON, min_size=MIN_DATETIME_SIZE_JSON
        )
    return DeclType("string", max_elements=_string_max_elements(schema), min_size=2)


def _object_type(schema: dict[str, Any]) -> DeclType | None:
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        value = schema_decl_type(extra, bool(extra.get("x-kubernetes-embedded-resource")))
        if value is None:
            return None
        if "maxProperties" in schema:
            entries = max(0, int(schema["maxProperties"]))
        else:  # estimateMaxAdditionalPropertiesFromMinSize
            entries = (MAX_REQUEST_SIZE_BYTES - 2) // (value.min_size + 6)
        return map_of(simple("string", MIN_STRING_SIZE), value, entries)
    required = set(schema.get("required") or [])
    fields: dict[str, DeclField] = {}
    min_size = 2  # {}
    for name, prop in (schema.get("properties") or {}).items():
        prop_type = schema_decl_type(prop, bool(prop.get("x-kubernetes-embedded-resource")))
        if prop_type is None:
            continue
        cel_name = escape(name)
        if cel_name is not None:
            fields[cel_name] = DeclField(prop_type, name in required, "default" in prop)
        if name in required and "default" not in prop:
            min_size += len(name) + prop_type.min_size + 4
    return DeclType("object", fields=fields, min_size=min_size)


def schema_decl_type(schema: dict[str, Any], is_resource_root: bool = False) -> DeclType | None:
    """SchemaDeclType: the CEL type of values of ``schema``, or None where CEL cannot see them."""
    if schema.get("x-kubernetes-int-or-string"):
        bound = (
            max(0, int(schema["maxLength"])) * 4
            if "maxLength" in schema
            else MAX_REQUEST_SIZE_BYTES - 2
        )
        return DeclType("dyn", max_elements=bound, min_size=1)
    if is_resource_root:
        schema = with_type_and_object_meta(schema)
    kind = schema.get("type")
    if kind == "array":
        items = schema.get("items")
        if not isinstance(items, dict):
            return None
        elem = schema_decl_type(items, bool(items.get("x-kubernetes-embedded-resource")))
        if elem is None:
            return None
        if "maxItems" in schema:
            count = max(0, int(schema["maxItems"]))
        else:  # estimateMaxArrayItemsFromMinSize
            count = (MAX_REQUEST_SIZE_BYTES - 2) // (elem.min_size + 1)
        return DeclType("list", elem=elem, max_elements=count, min_size=2)
    if kind == "object":
        return _object_type(schema)
    if kind == "string":
        return _string_type(schema)
    if kind == "boolean":
        return simple("bool", MIN_BOOL_SIZE)
    if kind == "number":
        return simple("double")
    if kind == "integer":
        return simple("int")
    return None  # no type (preserve-unknown-fields without type): not exposed to CEL


def max_cardinality(min_size: int) -> int:
    """celmodel.MaxCardinality: how often data of this minimum size fits in one request, the
    multiplier of a rule's cost when an enclosing list or map has no maxItems/maxProperties."""
    return MAX_REQUEST_SIZE_BYTES // (min_size + 1)
