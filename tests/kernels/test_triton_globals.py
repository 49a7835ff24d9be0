"""Globals that Triton kernels read must be ``tl.constexpr(...)`` instances: compiled Triton
refuses a module-level ``NAME: tl.constexpr = value`` annotation ("Cannot access global
variable ... from within @jit'ed function"), while the CPU interpreter accepts it, so only a
GPU would find out. Checked from the source of every kernel module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNEL_MODULES = sorted((Path(__file__).resolve().parents[2] / "pagoda_kernels" / "_triton").glob("*.py"))


@pytest.mark.parametrize("path", KERNEL_MODULES, ids=lambda p: p.name)
def test_module_level_constants_are_constexpr_instances(path: Path) -> None:
    tree = ast.parse(path.read_text())
    annotated = [
        node.target.id
        for node in tree.body
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and "constexpr" in ast.unparse(node.annotation)
    ]
    assert not annotated, (
        f"{path.name}: {annotated} are annotated as constexpr at module level; write "
        "NAME = tl.constexpr(value) so compiled kernels can read them"
    )
