"""What the checker, the function table and the macros share: the cost constants of cel-go
(common/cost.go), a checked sub-expression, and type compatibility."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .decl_types import DeclType, simple

MAX_UINT64 = 2**64 - 1
STRING_TRAVERSAL_COST_FACTOR = 0.1  # cel-go common/cost.go
REGEX_STRING_LENGTH_COST_FACTOR = 0.25
LIST_CREATE_BASE_COST = 10
MAP_CREATE_BASE_COST = 30

SCALARS = {"bool", "int", "uint", "double", "timestamp", "duration", "null_type"}
NUMBERS = {"int", "uint", "double"}
ORDERED = {"int", "uint", "double", "string", "bytes", "bool", "timestamp", "duration"}
TYPE_NAMES = {"int", "uint", "double", "bool", "string", "bytes", "list", "map", "null_type",
              "type", "dyn"}  # fmt: skip
DYN = simple("dyn")
BOOL = simple("bool", 4)
INT = simple("int")
STRING = simple("string", 2)


class CELTypeError(Exception):
    pass


@dataclass
class Typed:
    """A checked sub-expression: its type, its worst-case cost, and what its size is known by."""

    type: DeclType
    cost: int
    size: int | None = None  # computed: a literal's, or a call's result size
    rooted: bool = False  # reached from self/oldSelf by fields, items or values: schema sizes
    elem_size: int | None = None  # a list/map literal's largest element


def add(*costs: int) -> int:
    return min(sum(costs), MAX_UINT64)


def times(a: int, b: int) -> int:
    return min(a * b, MAX_UINT64)


def by_factor(size: int, factor: float) -> int:
    return min(math.ceil(size * factor), MAX_UINT64)


def size_of(node: Typed) -> int:
    """cel-go's sizeOrUnknown: computed size, then the schema's bound, then 1 for scalars."""
    if node.size is not None:
        return node.size
    if node.rooted and node.type.name not in SCALARS:
        return node.type.max_elements
    if node.type.name in SCALARS:
        return 1
    return MAX_UINT64


def compatible(a: DeclType, b: DeclType) -> bool:
    if "dyn" in (a.name, b.name):
        return True
    if a.name != b.name:
        return False
    if a.name == "list":
        return compatible(a.elem, b.elem)
    if a.name == "map":
        return compatible(a.key, b.key) and compatible(a.elem, b.elem)
    if a.name == "object":
        return a is b
    return True


def no_overload(function: str, *types: DeclType) -> CELTypeError:
    shown = ", ".join(str(t) for t in types)
    return CELTypeError(f"found no matching overload for '{function}' applied to '({shown})'")
