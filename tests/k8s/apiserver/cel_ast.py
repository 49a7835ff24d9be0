"""CEL source to a small AST, as cel-go's parser builds it (operators as calls, macros kept
as such), from cel-python's Lark grammar (celpy.celparser)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import lark
from celpy.celparser import CELParseError, CELParser


class CELSyntaxError(ValueError):
    pass


@dataclass
class Node:
    pass


@dataclass
class Literal(Node):
    kind: str  # int, uint, double, string, bytes, bool, null_type
    value: object


@dataclass
class Ident(Node):
    name: str


@dataclass
class Select(Node):
    operand: Node
    field: str


@dataclass
class Call(Node):
    function: str  # cel-go names: _+_, _==_, @in, !_, _?_:_, _[_], size, matches, ...
    args: list[Node]
    target: Node | None = None  # the receiver of x.f(...)


@dataclass
class Macro(Node):
    """has(), all(), exists(), exists_one(), map(), filter(): cel-go expands them at parse
    time (parser/macro.go); the checker and the coster here expand them the same way."""

    name: str
    target: Node | None
    args: list[Node] = field(default_factory=list)


@dataclass
class ListLiteral(Node):
    elements: list[Node]


@dataclass
class MapLiteral(Node):
    entries: list[tuple[Node, Node]]


BINARY = {
    "relation_lt": "_<_", "relation_le": "_<=_", "relation_gt": "_>_", "relation_ge": "_>=_",
    "relation_eq": "_==_", "relation_ne": "_!=_", "relation_in": "@in",
    "addition_add": "_+_", "addition_sub": "_-_",
    "multiplication_mul": "_*_", "multiplication_div": "_/_", "multiplication_mod": "_%_",
}  # fmt: skip
MACROS = {"has", "all", "exists", "exists_one", "map", "filter"}
NAMESPACES = {"sets", "strings", "math", "base64"}


@cache
def _parser() -> CELParser:
    return CELParser()


def parse(source: str) -> Node:
    try:
        tree = _parser().parse(source)
    except CELParseError as error:
        raise CELSyntaxError(f"Syntax error: {error}") from error
    return _convert(tree)


def _exprs(tree: lark.Tree | None) -> list[Node]:
    return [] if tree is None else [_convert(child) for child in tree.children]


def _convert(tree: lark.Tree | lark.Token) -> Node:  # noqa: C901 - one case per grammar rule
    if isinstance(tree, lark.Token):
        raise CELSyntaxError(f"unexpected token {tree!r}")
    rule, children = tree.data, tree.children
    if len(children) == 1 and rule in (
        "expr", "conditionalor", "conditionaland", "relation", "addition",
        "multiplication", "unary", "member", "primary", "paren_expr",
    ):  # fmt: skip
        return _convert(children[0])
    if rule == "expr":
        return Call("_?_:_", [_convert(child) for child in children])
    if rule in ("conditionalor", "conditionaland"):
        op = "_||_" if rule == "conditionalor" else "_&&_"
        return Call(op, [_convert(children[0]), _convert(children[1])])
    if rule in ("relation", "addition", "multiplication"):
        operator, rhs = children
        return Call(BINARY[operator.data], [_convert(operator.children[0]), _convert(rhs)])
    if rule == "unary":
        operator, operand = children
        if operator.data == "unary_not":
            return Call("!_", [_convert(operand)])
        inner = _convert(operand)
        if isinstance(inner, Literal) and inner.kind in ("int", "double"):
            return Literal(inner.kind, -inner.value)  # cel-go folds negative number literals
        return Call("-_", [inner])
    if rule == "member_dot":
        return Select(_convert(children[0]), str(children[1]))
    if rule == "member_dot_arg":
        return _member_call(_convert(children[0]), str(children[1]), _exprs(_arg(children)))
    if rule == "member_index":
        return Call("_[_]", [_convert(children[0]), _convert(children[1])])
    if rule == "ident_arg":
        name, args = str(children[0]), _exprs(_arg(children))
        return Macro(name, None, args) if name == "has" else Call(name, args)
    if rule == "ident":
        return Ident(str(children[0]))
    if rule == "list_lit":
        return ListLiteral(_exprs(children[0] if children else None))
    if rule == "map_lit":
        items = _exprs(children[0] if children else None)
        return MapLiteral(list(zip(items[::2], items[1::2], strict=True)))
    if rule == "literal":
        return _literal(children[0])
    raise CELSyntaxError(f"unsupported CEL syntax: {rule}")


def _arg(children: list) -> lark.Tree | None:
    """The argument list of a call, if it has arguments."""
    lists = [c for c in children if isinstance(c, lark.Tree) and c.data == "exprlist"]
    return lists[0] if lists else None


def _member_call(target: Node, name: str, args: list[Node]) -> Node:
    if isinstance(target, Ident) and target.name in NAMESPACES:
        return Call(f"{target.name}.{name}", args)
    if name in MACROS and name != "has" and len(args) in (2, 3):
        return Macro(name, target, args)
    return Call(name, args, target)


def _literal(token: lark.Token) -> Literal:
    text = str(token)
    if token.type == "INT_LIT":
        return Literal("int", int(text, 0))
    if token.type == "UINT_LIT":
        return Literal("uint", int(text[:-1], 0))
    if token.type == "FLOAT_LIT":
        return Literal("double", float(text))
    if token.type == "BOOL_LIT":
        return Literal("bool", text == "true")
    if token.type == "NULL_LIT":
        return Literal("null_type", None)
    if token.type == "BYTES_LIT":
        return Literal("bytes", _string_value(text[1:]).encode())
    return Literal("string", _string_value(text))


def _string_value(text: str) -> str:
    raw = text[0] in "rR"
    body = text[1:] if raw else text
    quote = 3 if body[:3] in ('"""', "'''") else 1
    inner = body[quote:-quote]
    if raw:
        return inner
    # CEL's escapes (\\n, \\x41, \\u00e9, ...) are Python's; other characters pass unchanged.
    return inner.encode("latin-1", "backslashreplace").decode("unicode_escape")
