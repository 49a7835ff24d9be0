"""Programmatic dependent launch (``pagoda_kernels/_triton/pdl.py``): a kernel launched with PDL
may start while its predecessor still runs, so it is correct only if it waits before its
first memory access. Checked from the source of every kernel module (each launched kernel
starts with ``wait_for_inputs()``, each launch says ``launch_pdl=``), and compiled for an
H200 and an A100 with Triton's own ptxas: the wait is there on sm_90 and absent on sm_80,
where the instruction does not exist."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from hopper_compile import run_compile_script

ROOT = Path(__file__).resolve().parents[2]
KERNEL_MODULES = sorted((ROOT / "pagoda_kernels" / "_triton").glob("*.py"))


def _launched_kernels(tree: ast.Module) -> set[str]:
    """Names ``k`` launched as ``k[grid](...)`` in the module."""
    return {
        node.func.value.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
        and isinstance(node.func.value, ast.Name)
    }  # fmt: skip


@pytest.mark.parametrize("path", KERNEL_MODULES, ids=lambda p: p.name)
def test_every_launched_kernel_waits_first_and_every_launch_says_pdl(path: Path) -> None:
    tree = ast.parse(path.read_text())
    jitted = {
        node.name: node for node in tree.body
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list)
    }  # fmt: skip
    imported = {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
                for alias in node.names}  # fmt: skip
    for name in _launched_kernels(tree):
        if name in jitted:
            body = [s for s in jitted[name].body
                    if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]  # fmt: skip
            assert ast.unparse(body[0]) == "wait_for_inputs()", (
                f"{path.name}: {name} must start with wait_for_inputs() (it is launched with PDL)"
            )
        else:
            assert name in imported, f"{path.name}: launches {name}, defined nowhere visible"
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
            keywords = {k.arg for k in node.keywords}
            assert "launch_pdl" in keywords, (
                f"{path.name}:{node.lineno}: a kernel launch without launch_pdl="
            )


def test_cpu_tensors_never_launch_with_pdl() -> None:
    from pagoda_kernels._triton.pdl import launch_pdl

    assert launch_pdl(torch.zeros(1)) is False


COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton.language.target_info as target_info
from pagoda_kernels._triton import rms_norm as r

for arch in (90, 80):
    target = GPUTarget("cuda", arch, 32)
    def current_target(target=target):  # what the GPU's driver would report
        return target
    current_target.__triton_builtin__ = True  # as Triton marks the original
    target_info.current_target = current_target
    signature = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16",
                 "out_ptr": "*bf16", "summed_ptr": "*bf16", "stride_x": "i32",
                 "stride_r": "i32", "stride_o": "i32", "stride_s": "i32", "eps": "fp32",
                 "HIDDEN": "constexpr", "BLOCK": "constexpr", "ADD_RESIDUAL": "constexpr"}
    names = r._rms_norm_kernel.arg_names
    consts = {(names.index("HIDDEN"),): 1536, (names.index("BLOCK"),): 2048,
              (names.index("ADD_RESIDUAL"),): True}
    src = ASTSource(r._rms_norm_kernel, signature, constexprs=consts)
    ptx = triton.compile(src, target=target, options={"num_warps": 4, "launch_pdl": True}).asm["ptx"]
    print(arch, "griddepcontrol.wait" in ptx, "griddepcontrol.launch_dependents" in ptx)
"""


def test_wait_compiles_for_hopper_only() -> None:
    done = run_compile_script(COMPILE_SCRIPT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["90 True True", "80 False False"], done.stdout
