"""Programmatic dependent launch (``kernels/_triton/pdl.py``): a kernel launched with PDL
may start while its predecessor still runs, so it is correct only if it waits before its
first memory access. Checked from the source of every kernel module (each launched kernel
waits with ``wait_for_inputs()`` before any memory access but the L2 prefetch of weights,
each launch says ``launch_pdl=``), and compiled for an H200 and an A100 with Triton's own
ptxas: the wait and the prefetch are there on sm_90 and absent on sm_80."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
KERNEL_MODULES = sorted((ROOT / "kernels" / "_triton").glob("*.py"))


def _launched_kernels(tree: ast.Module) -> set[str]:
    """Names ``k`` launched as ``k[grid](...)`` in the module."""
    return {
        node.func.value.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
        and isinstance(node.func.value, ast.Name)
    }  # fmt: skip


# What a kernel may call before wait_for_inputs(): index arithmetic, and the L2 prefetch
# of weights (no kernel writes them).
PURE_TL = {"program_id", "arange", "minimum", "maximum", "zeros", "full", "cdiv"}


def _touches_memory(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            if func.value.id == "tl" and func.attr in PURE_TL:
                continue
            if func.attr == "to":
                continue
        if isinstance(func, ast.Attribute) and func.attr == "to":
            continue
        if isinstance(func, ast.Name) and func.id == "prefetch_l2":
            continue
        return True
    return False


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
            body = [ast.unparse(s) for s in jitted[name].body]
            assert "wait_for_inputs()" in body, f"{path.name}: {name} never waits for its inputs"
            before = body[: body.index("wait_for_inputs()")]
            touching = [s for s in before if _touches_memory(ast.parse(s))]
            assert not touching, (
                f"{path.name}: {name} touches memory before wait_for_inputs() (it is launched "
                f"with PDL, so its predecessor may still be running): {touching}"
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
    from kernels._triton.pdl import launch_pdl

    assert launch_pdl(torch.zeros(1)) is False


COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton.language.target_info as target_info
from kernels._triton import fp8_linear as f, linear as g, rms_norm as r

INTS = {k: "i32" for k in ["M", "N", "K", "stride_xm", "stride_wn", "stride_om", "k_per_split"]}
NORM = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*bf16",
        "summed_ptr": "*bf16", "stride_x": "i32", "stride_r": "i32", "stride_o": "i32",
        "stride_s": "i32", "eps": "fp32"}
GEMV = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16",
        "ws_ptr": "*fp32", **INTS}
FP8 = {"x_ptr": "*bf16", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32",
       "b_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32", **INTS}
CASES = [
    (r._rms_norm_kernel, NORM, dict(HIDDEN=1536, BLOCK=2048, ADD_RESIDUAL=True), 1),
    (g._gemv_fma_kernel, GEMV, dict(ROWS=1, BLOCK_N=4, BLOCK_K=512, USE_WS=False,
     HAS_BIAS=False, EVEN_K=True, VEC=8, GATED=True), 1),
    (g._gemv_dot_kernel, GEMV, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, USE_WS=True,
     HAS_BIAS=False, EVEN_K=False, PRECISION="tf32"), 3),
    (f._fp8_gemv_kernel, FP8, dict(ROWS=2, BLOCK_N=4, BLOCK_K=1024, USE_WS=False,
     HAS_BIAS=True, EVEN_K=True, VEC=16, PREQUANT=False), 1),
    (f._fp8_gemv_dot_kernel, FP8, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, USE_WS=False,
     HAS_BIAS=True, EVEN_K=True, PREQUANT=False), 3),
]
for arch in (90, 80):
    target = GPUTarget("cuda", arch, 32)
    def current_target(target=target):  # what the GPU's driver would report
        return target
    current_target.__triton_builtin__ = True  # as Triton marks the original
    target_info.current_target = current_target
    for kernel, types, consts, stages in CASES:
        if arch < 89 and types is FP8:
            continue  # e4m3 starts at sm_89
        signature = {**types, **{k: "constexpr" for k in consts}}
        constexprs = {(kernel.arg_names.index(k),): v for k, v in consts.items()}
        src = ASTSource(kernel, signature, constexprs=constexprs)
        options = {"num_warps": 4, "num_stages": stages, "launch_pdl": True}
        ptx = triton.compile(src, target=target, options=options).asm["ptx"]
        print(arch, kernel.__name__, "griddepcontrol.wait" in ptx,
              "griddepcontrol.launch_dependents" in ptx, "prefetch.global.L2" in ptx)
"""


def test_wait_compiles_for_hopper_only() -> None:
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().split("\n")
    gemv = ("_gemv_fma_kernel", "_gemv_dot_kernel", "_fp8_gemv_kernel", "_fp8_gemv_dot_kernel")
    expected = [f"{arch} {name} {arch == 90} {arch == 90} {arch == 90 and name in gemv}"
                for arch in (90, 80) for name in ("_rms_norm_kernel", *gemv)
                if arch == 90 or "fp8" not in name]  # fmt: skip
    assert lines == expected, done.stdout
