"""Operators and functions of the API server's CEL environment: their overloads and costs.

Overloads: cel-go's standard declarations (checker/decls, common/stdlib) with
CrossTypeNumericComparisons, plus the libraries k8s.io/apiserver/pkg/cel/environment/base.go
adds: ext.Strings v2, library.Lists, library.Regex, library.URLs, library.Quantity, ext.Sets.
Costs: cel-go checker/cost.go functionCost (O(1) calls cost 1) and, for the k8s library,
k8s.io/apiserver/pkg/cel/library/cost.go, rounded up where marked.
"""

from __future__ import annotations

from .cel_core import (
    BOOL,
    DYN,
    INT,
    MAX_UINT64,
    NUMBERS,
    ORDERED,
    REGEX_STRING_LENGTH_COST_FACTOR,
    STRING,
    STRING_TRAVERSAL_COST_FACTOR,
    CELTypeError,
    Typed,
    add,
    by_factor,
    compatible,
    no_overload,
    size_of,
    times,
)
from .decl_types import DeclType, list_of, simple

OPERATORS = {
    "_&&_", "_||_", "!_", "-_", "_?_:_", "_[_]", "_==_", "_!=_", "_<_", "_<=_", "_>_",
    "_>=_", "@in", "_+_", "_-_", "_*_", "_/_", "_%_",
}  # fmt: skip
LIST_OF_STRING = list_of(STRING, 0)

# receiver-style string functions: name -> {argument types: result}
STRING_METHODS: dict[str, dict[tuple[str, ...], DeclType]] = {
    "contains": {("string",): BOOL},
    "startsWith": {("string",): BOOL},
    "endsWith": {("string",): BOOL},
    "matches": {("string",): BOOL},
    "charAt": {("int",): STRING},
    "indexOf": {("string",): INT, ("string", "int"): INT},
    "lastIndexOf": {("string",): INT, ("string", "int"): INT},
    "lowerAscii": {(): STRING},
    "upperAscii": {(): STRING},
    "trim": {(): STRING},
    "replace": {("string", "string"): STRING, ("string", "string", "int"): STRING},
    "split": {("string",): LIST_OF_STRING, ("string", "int"): LIST_OF_STRING},
    "substring": {("int",): STRING, ("int", "int"): STRING},
    "find": {("string",): STRING},
    "findAll": {("string",): LIST_OF_STRING, ("string", "int"): LIST_OF_STRING},
}
LIST_METHODS = {"isSorted", "sum", "min", "max", "indexOf", "lastIndexOf", "join"}
CONVERSIONS = {"int", "uint", "double", "string", "bytes", "bool", "duration", "timestamp"}
# global functions over strings: name -> result
STRING_GLOBALS = {
    "url": simple("URL"), "isURL": BOOL, "quantity": simple("Quantity"), "isQuantity": BOOL,
    "strings.quote": STRING,
}  # fmt: skip
SET_FUNCTIONS = {"sets.contains", "sets.intersects", "sets.equivalent"}


def _kinds(*args: Typed) -> list[str]:
    return [arg.type.name for arg in args]


def _logical(function: str, args: list[Typed]) -> Typed:
    if any(kind not in ("bool", "dyn") for kind in _kinds(*args)):
        raise no_overload(function, *(arg.type for arg in args))
    if function == "!_":
        return Typed(BOOL, add(1, args[0].cost))
    return Typed(BOOL, add(args[0].cost, args[1].cost))  # && and || add no cost of their own


def _conditional(args: list[Typed]) -> Typed:
    condition, if_true, if_false = args
    if condition.type.name not in ("bool", "dyn") or not compatible(if_true.type, if_false.type):
        raise no_overload("_?_:_", *(arg.type for arg in args))
    result = if_true.type if if_true.type.name != "dyn" else if_false.type
    size = max(size_of(if_true), size_of(if_false))
    return Typed(result, add(condition.cost, max(if_true.cost, if_false.cost)), size=size)


def _index(args: list[Typed]) -> Typed:
    container, index = args
    kind = container.type.name
    cost = add(1, container.cost, index.cost)
    if kind == "list" and index.type.name in ("int", "dyn"):
        return Typed(container.type.elem, cost, rooted=container.rooted)
    if kind == "map" and compatible(container.type.key, index.type):
        return Typed(container.type.elem, cost, rooted=container.rooted)
    if kind == "dyn":
        return Typed(DYN, cost)
    raise no_overload("_[_]", container.type, index.type)


def _comparison(function: str, args: list[Typed]) -> Typed:
    lhs, rhs = args
    a, b = lhs.type, rhs.type
    if function in ("_==_", "_!=_"):
        null_check = "null_type" in (a.name, b.name)
        if not (compatible(a, b) or null_check):
            raise no_overload(function, a, b)
    elif not (
        "dyn" in (a.name, b.name)
        or (a.name == b.name and a.name in ORDERED)
        or (a.name in NUMBERS and b.name in NUMBERS)  # CrossTypeNumericComparisons
    ):
        raise no_overload(function, a, b)
    if function in ("_==_", "_!=_") or a.name in ("string", "bytes"):
        # cost.go: equality and string ordering traverse the shorter operand
        smallest = min(size_of(lhs), size_of(rhs))
        own = by_factor(smallest, STRING_TRAVERSAL_COST_FACTOR)
    else:
        own = 1
    return Typed(BOOL, add(own, lhs.cost, rhs.cost))


def _membership(args: list[Typed]) -> Typed:
    element, container = args
    kind = container.type.name
    if kind == "list" and compatible(element.type, container.type.elem):
        own = size_of(container)  # cost.go InList: O(n)
    elif kind == "map" and compatible(element.type, container.type.key):
        own = 1
    elif kind == "dyn":
        own = size_of(container)
    else:
        raise no_overload("@in", element.type, container.type)
    return Typed(BOOL, add(own, element.cost, container.cost))


def _arithmetic(function: str, args: list[Typed]) -> Typed:
    if function == "-_":
        (operand,) = args
        if operand.type.name not in ("int", "double", "duration", "dyn"):
            raise no_overload(function, operand.type)
        return Typed(operand.type, add(1, operand.cost))
    lhs, rhs = args
    a, b = lhs.type.name, rhs.type.name
    cost = add(lhs.cost, rhs.cost)
    if "dyn" in (a, b):
        return Typed(rhs.type if a == "dyn" else lhs.type, add(1, cost))
    allowed = {"_+_": {"int", "uint", "double", "string", "bytes", "list", "duration"},
               "_-_": {"int", "uint", "double", "duration", "timestamp"},
               "_*_": NUMBERS, "_/_": NUMBERS, "_%_": {"int", "uint"}}[function]  # fmt: skip
    if a == b and a in allowed and compatible(lhs.type, rhs.type):
        if function == "_+_" and a in ("string", "bytes", "list"):
            size = add(size_of(lhs), size_of(rhs))
            own = 1 if a == "list" else by_factor(size, STRING_TRAVERSAL_COST_FACTOR)
            return Typed(lhs.type, add(own, cost), size=size)
        result = simple("duration") if a == "timestamp" else lhs.type  # timestamp - timestamp
        return Typed(result, add(1, cost))
    if (function, a, b) in (
        ("_+_", "timestamp", "duration"), ("_+_", "duration", "timestamp"),
        ("_-_", "timestamp", "duration"),
    ):  # fmt: skip
        return Typed(simple("timestamp"), add(1, cost))
    raise no_overload(function, lhs.type, rhs.type)


def check_operator(function: str, args: list[Typed]) -> Typed:
    if function in ("_&&_", "_||_", "!_"):
        return _logical(function, args)
    if function == "_?_:_":
        return _conditional(args)
    if function == "_[_]":
        return _index(args)
    if function in ("_==_", "_!=_", "_<_", "_<=_", "_>_", "_>=_"):
        return _comparison(function, args)
    if function == "@in":
        return _membership(args)
    return _arithmetic(function, args)


def check_function(function: str, target: Typed | None, args: list[Typed]) -> Typed:
    """A call of a named function, ``f(args)`` or ``target.f(args)``."""
    arg_cost = add(*(arg.cost for arg in args), target.cost if target else 0)
    if function == "size":
        (operand,) = [target] if target else args
        if operand.type.name not in ("string", "bytes", "list", "map", "dyn"):
            raise no_overload("size", operand.type)
        return Typed(INT, add(1, arg_cost))
    if target is None:
        return _check_global(function, args, arg_cost)
    kind = target.type.name
    if kind == "list" and function in LIST_METHODS:
        return _check_list_method(function, target, args, arg_cost)
    if kind in ("string", "dyn") and function in STRING_METHODS:
        overloads = STRING_METHODS[function]
        argument_kinds = tuple(_kinds(*args))
        result = next(
            (r for kinds, r in overloads.items() if _kinds_match(kinds, argument_kinds)), None
        )
        if result is None:
            raise no_overload(function, target.type, *(arg.type for arg in args))
        own, size = _string_cost(function, target, args)
        return Typed(result, add(own, arg_cost), size=size)
    raise no_overload(function, target.type, *(arg.type for arg in args))


def _kinds_match(declared: tuple[str, ...], actual: tuple[str, ...]) -> bool:
    return len(declared) == len(actual) and all(
        d == a or a == "dyn" for d, a in zip(declared, actual, strict=True)
    )


def _check_global(function: str, args: list[Typed], arg_cost: int) -> Typed:
    if function == "dyn" and len(args) == 1:
        return Typed(DYN, add(1, arg_cost), size=args[0].size, rooted=args[0].rooted)
    if function == "type" and len(args) == 1:
        return Typed(simple("type"), add(1, arg_cost))
    if function in CONVERSIONS and len(args) == 1:
        if args[0].type.name in ("list", "map", "object"):
            raise no_overload(function, args[0].type)
        kind = "timestamp" if function == "timestamp" else function
        keeps_size = function == args[0].type.name
        size = size_of(args[0]) if keeps_size else None
        return Typed(simple(kind), add(1, arg_cost), size=size, rooted=args[0].rooted)
    if function == "matches" and _kinds(*args) == ["string", "string"]:
        return Typed(BOOL, add(_regex_cost(args[0], args[1]), arg_cost))
    if function in STRING_GLOBALS and len(args) == 1 and _kinds(*args)[0] in ("string", "dyn"):
        own = by_factor(size_of(args[0]), STRING_TRAVERSAL_COST_FACTOR)
        return Typed(STRING_GLOBALS[function], add(own, arg_cost))
    if function in SET_FUNCTIONS and _kinds(*args) == ["list", "list"]:
        return Typed(BOOL, add(times(size_of(args[0]), size_of(args[1])), arg_cost))
    if function in SET_FUNCTIONS or function in CONVERSIONS or function in STRING_GLOBALS:
        raise no_overload(function, *(arg.type for arg in args))
    raise CELTypeError(f"undeclared reference to '{function}' (in container '')")


def _check_list_method(function: str, target: Typed, args: list[Typed], arg_cost: int) -> Typed:
    elem = target.type.elem
    argument_kinds = _kinds(*args)
    if function == "join":
        if elem.name not in ("string", "dyn") or argument_kinds not in ([], ["string"]):
            raise no_overload(function, target.type, *(arg.type for arg in args))
        size = times(size_of(target), max(1, _element_size(target)))
        return Typed(STRING, add(by_factor(size, STRING_TRAVERSAL_COST_FACTOR), arg_cost), size)
    if function in ("indexOf", "lastIndexOf"):
        if len(args) != 1 or not compatible(args[0].type, elem):
            raise no_overload(function, target.type, *(arg.type for arg in args))
        result = INT
    elif args:
        raise no_overload(function, target.type, *(arg.type for arg in args))
    else:
        result = BOOL if function == "isSorted" else elem
    # library/cost.go: one comparison per element, strings also traversed
    per_element = 1
    if elem.name in ("string", "bytes"):
        per_element = add(1, by_factor(_element_size(target), STRING_TRAVERSAL_COST_FACTOR))
    return Typed(result, add(times(size_of(target), per_element), arg_cost))


def _element_size(container: Typed) -> int:
    if container.elem_size is not None:  # a literal's elements
        return container.elem_size
    return size_of(Typed(container.type.elem, 0, rooted=container.rooted))


def _regex_cost(text: Typed, pattern: Typed) -> int:
    # cost.go MatchesString: (size+1) x 0.1 traversal times size(regex) x 0.25
    traversal = by_factor(min(add(size_of(text), 1), MAX_UINT64), STRING_TRAVERSAL_COST_FACTOR)
    return times(traversal, by_factor(size_of(pattern), REGEX_STRING_LENGTH_COST_FACTOR))


def _string_cost(function: str, target: Typed, args: list[Typed]) -> tuple[int, int | None]:
    """Own cost and result size of ``target.function(args)`` on a string."""
    size = size_of(target)
    traversal = by_factor(size, STRING_TRAVERSAL_COST_FACTOR)
    if function == "matches":
        return _regex_cost(target, args[0]), None
    if function in ("find", "findAll"):
        return _regex_cost(target, args[0]), size
    if function in ("startsWith", "endsWith"):
        return by_factor(size_of(args[0]), STRING_TRAVERSAL_COST_FACTOR), None
    if function == "contains":
        return times(traversal, by_factor(size_of(args[0]), STRING_TRAVERSAL_COST_FACTOR)), None
    if function == "replace":
        # library/cost.go charges the traversal and the built result; bounded here by a result
        # as long as the target times the replacement (an over-estimate).
        result = times(size, max(1, size_of(args[1])))
        return add(traversal, by_factor(result, STRING_TRAVERSAL_COST_FACTOR)), result
    if function in ("lowerAscii", "upperAscii", "trim", "substring", "split"):
        return traversal, size
    return add(1, traversal), None  # charAt, indexOf, lastIndexOf: one traversal at most
