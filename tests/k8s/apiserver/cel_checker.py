"""Type-check a CEL rule against a schema's CEL types and estimate its worst-case cost.

The checker follows cel-go's checker as the API server configures it
(k8s.io/apiserver/pkg/cel/environment/base.go): declared fields only (``undefined field``),
HomogeneousAggregateLiterals, CrossTypeNumericComparisons (``1 < 1.5`` compiles, from
compatibility version 1.28; ``1 == 1.5`` and ``1 + 1.5`` still do not: equality and arithmetic
need one type), the ext.Strings, k8s lists/regex/url/quantity and ext.Sets libraries, and a
rule must evaluate to bool (apiextensions-apiserver .../schema/cel/compilation.go).

The cost model is cel-go's checker/cost.go (constants from common/cost.go) with the API server's
size estimator (sizes from maxLength/maxItems/maxProperties, see decl_types.py) and
PresenceTestHasCost(false) (has() is free). Costs of the k8s library functions
(k8s.io/apiserver/pkg/cel/library/cost.go) are modelled for the functions listed in
_library_cost and rounded up where the real formula is finer: the result is an upper bound of
what the API server computes, not the exact number. Only maxima are tracked (the limits are
checked against the maximum).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .cel_ast import (
    Call,
    CELSyntaxError,
    Ident,
    ListLiteral,
    Literal,
    Macro,
    MapLiteral,
    Node,
    Select,
    parse,
)
from .cel_core import (
    DYN,
    LIST_CREATE_BASE_COST,
    MAP_CREATE_BASE_COST,
    TYPE_NAMES,
    CELTypeError,
    Typed,
    add,
    compatible,
    size_of,
)
from .cel_functions import OPERATORS, check_function, check_operator
from .cel_macros import check_macro
from .decl_types import DeclType, list_of, simple


@dataclass
class CompiledRule:
    error: str | None
    max_cost: int = 0
    uses_old_self: bool = False


def compile_rule(rule: str, self_type: DeclType) -> CompiledRule:
    """What the API server's compileRule makes of ``rule`` on a schema of ``self_type``."""
    checker = Checker({"self": Typed(self_type, 1, rooted=True),
                       "oldSelf": Typed(self_type, 1, rooted=True)})  # fmt: skip
    try:
        result = checker.check(parse(rule))
    except (CELTypeError, CELSyntaxError) as error:
        return CompiledRule(f"compilation failed: ERROR: <input>: {error}")
    if result.type.name != "bool":
        return CompiledRule("cel expression must evaluate to a bool")
    return CompiledRule(None, result.cost, checker.uses_old_self)


class Checker:
    def __init__(self, variables: dict[str, Typed]) -> None:
        self.scopes = [variables]
        self.uses_old_self = False

    def lookup(self, name: str) -> Typed | None:
        for scope in reversed(self.scopes):
            if name in scope:
                if name == "oldSelf" and scope is self.scopes[0]:
                    self.uses_old_self = True
                return scope[name]
        return None

    def check(self, node: Node) -> Typed:
        if isinstance(node, Literal):
            size = len(node.value) if node.kind in ("string", "bytes") else 1
            return Typed(simple(node.kind), 0, size=size)
        if isinstance(node, Ident):
            return self.check_ident(node)
        if isinstance(node, Select):
            return self.check_select(node)
        if isinstance(node, ListLiteral):
            return self.check_list(node)
        if isinstance(node, MapLiteral):
            return self.check_map(node)
        if isinstance(node, Macro):
            return check_macro(self, node)
        if isinstance(node, Call):
            return self.check_call(node)
        raise CELTypeError(f"unsupported expression {node!r}")

    def check_ident(self, node: Ident) -> Typed:
        variable = self.lookup(node.name)
        if variable is not None:
            return replace(variable, cost=1)
        if node.name in TYPE_NAMES:
            # cel-go gives an identifier the path [name]; the API server's size estimator drops
            # the first element and answers with the root object's size, 0.
            return Typed(simple("type"), 1, size=0)
        raise CELTypeError(f"undeclared reference to '{node.name}' (in container '')")

    def check_select(self, node: Select) -> Typed:
        operand = self.check(node.operand)
        kind = operand.type.name
        if kind == "object":
            declared = operand.type.fields.get(node.field)
            if declared is None:
                raise CELTypeError(f"undefined field '{node.field}'")
            return Typed(declared.type, add(operand.cost, 1), rooted=operand.rooted)
        if kind == "map":
            return Typed(operand.type.elem, add(operand.cost, 1), rooted=operand.rooted)
        if kind == "dyn":
            return Typed(DYN, operand.cost, rooted=operand.rooted)
        raise CELTypeError(f"type '{operand.type}' does not support field selection")

    def check_list(self, node: ListLiteral) -> Typed:
        elements = [self.check(element) for element in node.elements]
        elem_type = self.homogeneous([element.type for element in elements])
        cost = add(LIST_CREATE_BASE_COST, *(element.cost for element in elements))
        elem_size = max((size_of(element) for element in elements), default=0)
        return Typed(list_of(elem_type, len(elements)), cost, len(elements), elem_size=elem_size)

    def check_map(self, node: MapLiteral) -> Typed:
        keys = [self.check(key) for key, _ in node.entries]
        values = [self.check(value) for _, value in node.entries]
        key_type = self.homogeneous([key.type for key in keys])
        value_type = self.homogeneous([value.type for value in values])
        cost = add(MAP_CREATE_BASE_COST, *(part.cost for part in keys + values))
        result = DeclType("map", key=key_type, elem=value_type, max_elements=len(keys))
        elem_size = max((size_of(value) for value in values), default=0)
        return Typed(result, cost, len(keys), elem_size=elem_size)

    @staticmethod
    def homogeneous(types: list[DeclType]) -> DeclType:
        """HomogeneousAggregateLiterals: one element type per literal (dyn aside)."""
        concrete = [t for t in types if t.name != "dyn"]
        for other in concrete[1:]:
            if not compatible(concrete[0], other):
                raise CELTypeError(f"expected type '{concrete[0]}' but found '{other}'")
        return concrete[0] if concrete else DYN

    def check_call(self, node: Call) -> Typed:
        args = [self.check(arg) for arg in node.args]
        if node.function in OPERATORS:
            return check_operator(node.function, args)
        target = self.check(node.target) if node.target is not None else None
        return check_function(node.function, target, args)
