"""CEL macros as cel-go expands them (parser/macro.go) and as checker/cost.go then costs the
comprehension: iterRange + accuInit + result + size(range) x (loopStep + loopCondition).

The per-element and fixed costs below are those of the expanded forms:
  all(x, p)        accu true,  cond @not_strictly_false(__result__) = 2, step __result__ && p = 1+p
  exists(x, p)     accu false, cond @not_strictly_false(!__result__) = 3, step __result__ || p = 1+p
  exists_one(x, p) accu 0, cond true = 0, step p ? __result__ + 1 : __result__ = p+2,
                   result __result__ == 1 = 2
  filter(x, p)     accu [] = 10, cond true, step p ? __result__ + [x] : __result__ = p+13
  map(x, f)        accu [] = 10, cond true, step __result__ + [f] = f+12
and every result __result__ costs 1 (an identifier). has() costs nothing of its own
(PresenceTestHasCost(false) in k8s.io/apiserver/pkg/cel/environment/base.go).
"""

from __future__ import annotations

from typing import Protocol

from .cel_ast import Ident, Macro, Node, Select
from .cel_core import BOOL, DYN, INT, CELTypeError, Typed, add, size_of, times
from .decl_types import list_of

# name -> (fixed cost: accuInit + result + condition-free parts, per-element cost besides body)
COMPREHENSIONS = {
    "all": (0 + 1, 1 + 2),
    "exists": (0 + 1, 1 + 3),
    "exists_one": (0 + 2, 2),
    "filter": (10 + 1, 13),
    "map": (10 + 1, 12),
}


class Checks(Protocol):
    scopes: list[dict[str, Typed]]

    def check(self, node: Node) -> Typed: ...


def check_macro(checker: Checks, node: Macro) -> Typed:
    if node.name == "has":
        return _check_has(checker, node)
    iter_range = checker.check(node.target)
    names = node.args[:-1] if node.name != "map" or len(node.args) == 2 else node.args[:1]
    if not all(isinstance(name, Ident) for name in names):
        raise CELTypeError(f"{node.name}() argument must be a simple name")
    bound = _bind(iter_range, [name.name for name in names], node.name)
    checker.scopes.append(bound)
    try:
        body = [checker.check(arg) for arg in node.args[len(names) :]]
    finally:
        checker.scopes.pop()
    fixed, per_element = COMPREHENSIONS[node.name]
    if node.name != "map" or len(body) == 2:  # map(x, p, f) filters by p first
        if body[0].type.name not in ("bool", "dyn"):
            raise CELTypeError(f"{node.name}() predicate must be bool, found '{body[0].type}'")
    step = add(per_element, *(part.cost for part in body))
    cost = add(iter_range.cost, fixed, times(size_of(iter_range), step))
    if node.name in ("all", "exists", "exists_one"):
        return Typed(BOOL, cost)
    elem = body[-1].type if node.name == "map" else bound[names[-1].name].type
    return Typed(list_of(elem, size_of(iter_range)), cost, size=size_of(iter_range))


def _check_has(checker: Checks, node: Macro) -> Typed:
    (argument,) = node.args
    if not isinstance(argument, Select):
        raise CELTypeError("invalid argument to has() macro")
    operand = checker.check(argument.operand)
    kind = operand.type.name
    if kind == "object" and argument.field not in operand.type.fields:
        raise CELTypeError(f"undefined field '{argument.field}'")
    if kind not in ("object", "map", "dyn"):
        raise CELTypeError(f"type '{operand.type}' does not support field selection")
    return Typed(BOOL, operand.cost)


def _bind(iter_range: Typed, names: list[str], macro: str) -> dict[str, Typed]:
    """The iteration variables: a list's elements (and index), a map's keys (and values)."""
    kind = iter_range.type.name
    rooted = iter_range.rooted
    if kind == "list":
        element = Typed(iter_range.type.elem, 1, size=iter_range.elem_size, rooted=rooted)
        first = Typed(INT, 1)
    elif kind == "map":
        element = Typed(iter_range.type.elem, 1, size=iter_range.elem_size, rooted=rooted)
        first = Typed(iter_range.type.key, 1, rooted=rooted)
    elif kind == "dyn":
        element = first = Typed(DYN, 1)
    else:
        raise CELTypeError(
            f"expression of type '{iter_range.type}' cannot be range of a comprehension"
            " (must be list, map, or dynamic)"
        )
    if len(names) == 1:
        return {names[0]: element if kind == "list" else first}
    if macro not in ("all", "exists"):
        raise CELTypeError(f"{macro}() takes one iteration variable")
    return {names[0]: first, names[1]: element}  # ext.TwoVarComprehensions (1.32+)
