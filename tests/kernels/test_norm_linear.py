"""RMSNorm (+ residual add) fused into the following projection (``kernels.rms_norm_linear``
and its gate_up + SiLU-and-mul form): the Triton fma kernel under the interpreter against
float64, the residual it writes against the unfused kernel's, and the dispatch rules
(fallback to the unfused ops, the ``PAGODA_DISABLE_NORM_FUSION`` switch)."""

import pytest
import torch

import kernels
from kernels._float64 import rel_err, rms_norm64, silu_and_mul64
from kernels._gemv_table import GemvConfig

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-6


def inputs(m: int, n: int, k: int, dtype: torch.dtype, residual: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    res = (3 * torch.randn(m, k, generator=gen)).to(dtype) if residual else None
    norm = (1 + 0.2 * torch.randn(k, generator=gen)).to(dtype)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    return x, res, norm, weight, bias


def truth(x, residual, norm, weight, bias=None, gated=False):
    """float64 of the composed ops, from the residual stream as the model's dtype holds it
    (x + residual rounded once, as both paths store it)."""
    summed = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    out = rms_norm64(summed, norm, EPS) @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return silu_and_mul64(out) if gated else out


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[GemvConfig]:
    """Configs the fused kernel ran with (empty: the op ran the unfused ops)."""
    from kernels._triton import linear as triton_linear

    calls: list[GemvConfig] = []
    original = triton_linear.rms_norm_linear

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args[6])
        return original(*args, **kwargs)

    monkeypatch.setattr(triton_linear, "rms_norm_linear", spy)
    return calls


def unfused_residual(x, residual, norm):
    """The residual the unfused Triton kernel stores (the interpreter rounds like itself)."""
    if residual is None:
        return x
    return kernels.fused_add_rms_norm(x, residual.clone(), norm, EPS)[1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "residual"), [(1, True), (1, False), (3, True), (5, False)])
def test_matches_float64(dtype: torch.dtype, m: int, residual: bool, fused_calls: list) -> None:
    x, res, norm, weight, bias = inputs(m, 40, 96, dtype, residual, seed=m)
    res_before = None if res is None else res.clone()
    out, summed = kernels.rms_norm_linear(x, res, norm, EPS, weight, bias)
    assert fused_calls, "the fused kernel should run under the interpreter"
    assert out.shape == (m, 40) and out.dtype == dtype
    assert rel_err(out, truth(x, res, norm, weight, bias)) <= TOLERANCE[dtype]
    assert torch.equal(summed, unfused_residual(x, res_before, norm))
    if residual:
        assert torch.equal(res, res_before)  # other programs read it: never written in place
    else:
        assert summed is x
    ref, _ = kernels.rms_norm_linear_ref(x, res_before, norm, EPS, weight, bias)
    assert rel_err(out, ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "residual"), [(1, True), (3, False)])
def test_gated_matches_float64(dtype: torch.dtype, m: int, residual: bool, fused_calls: list) -> None:
    x, res, norm, weight, _ = inputs(m, 2 * 24, 80, dtype, residual, seed=10 + m)
    res_before = None if res is None else res.clone()
    out, summed = kernels.rms_norm_linear_silu_and_mul(x, res, norm, EPS, weight)
    assert fused_calls
    assert out.shape == (m, 24)
    assert rel_err(out, truth(x, res_before, norm, weight, gated=True)) <= TOLERANCE[dtype]
    assert torch.equal(summed, unfused_residual(x, res_before, norm))


# Every row bucket (1, 2, 4, 8), K tiles that do not divide K, more than one K tile (the
# sums of squares span the loop), N not a multiple of the row block, a split-K config
# (the fused launch runs it unsplit: the statistics need the whole row).
CONFIGS = [
    (1, GemvConfig("fma", 1, 64)),
    (2, GemvConfig("fma", 2, 64)),
    (4, GemvConfig("fma", 4, 16, split_k=4)),
    (7, GemvConfig("fma", 8, 128)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize(("m", "config"), CONFIGS, ids=[c.short() for _, c in CONFIGS])
def test_kernel_configs(dtype: torch.dtype, gated: bool, m: int, config: GemvConfig) -> None:
    from kernels._triton import linear as triton_linear

    x, res, norm, weight, bias = inputs(m, 38 if gated else 19, 70, dtype, True, seed=3)
    bias = None if gated else bias
    out, summed = triton_linear.rms_norm_linear(x, res, norm, EPS, weight, bias, config,
                                                gated=gated)  # fmt: skip
    assert rel_err(out, truth(x, res, norm, weight, bias, gated)) <= TOLERANCE[dtype]
    assert torch.equal(summed, unfused_residual(x, res, norm))
    again, _ = triton_linear.rms_norm_linear(x, res, norm, EPS, weight, bias, config,
                                             gated=gated)  # fmt: skip
    assert torch.equal(out, again)


def test_fallbacks_run_the_unfused_ops(fused_calls: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside the fused kernel's cases the op is the unfused composition, exactly."""
    x, res, norm, weight, bias = inputs(12, 24, 48, torch.float32, True)

    def unfused(x, res, norm, weight, bias):
        normed, summed = kernels.fused_add_rms_norm(x, res.clone(), norm, EPS)
        return kernels.linear(normed, weight, bias), summed

    cases = {
        "more rows than the fma kernel": (x, res, norm, weight, bias),
        "strided norm weight": (x[:2], res[:2], torch.randn(96)[::2], weight, bias),
        "K-strided x": (torch.randn(2, 96)[:, ::2], res[:2], norm, weight, bias),
    }
    for name, (cx, cres, cnorm, cweight, cbias) in cases.items():
        out, summed = kernels.rms_norm_linear(cx, cres.clone(), cnorm, EPS, cweight, cbias)
        expected, expected_sum = unfused(cx, cres, cnorm, cweight, cbias)
        assert torch.equal(out, expected) and torch.equal(summed, expected_sum), name
    assert fused_calls == []
    monkeypatch.setenv("PAGODA_DISABLE_NORM_FUSION", "1")
    out, summed = kernels.rms_norm_linear(x[:2], res[:2].clone(), norm, EPS, weight, bias)
    expected, expected_sum = unfused(x[:2], res[:2], norm, weight, bias)
    assert torch.equal(out, expected) and torch.equal(summed, expected_sum)
    gated, _ = kernels.rms_norm_linear_silu_and_mul(x[:2], None, norm, EPS, weight)
    assert torch.equal(gated, kernels.linear_silu_and_mul(kernels.rms_norm(x[:2], norm, EPS), weight))
    assert fused_calls == []
    monkeypatch.delenv("PAGODA_DISABLE_NORM_FUSION")
    monkeypatch.delenv("TRITON_INTERPRET")  # CPU without the interpreter: the references
    out, summed = kernels.rms_norm_linear(x[:2], res[:2], norm, EPS, weight, bias)
    ref, ref_sum = kernels.rms_norm_linear_ref(x[:2], res[:2], norm, EPS, weight, bias)
    assert torch.equal(out, ref) and torch.equal(summed, ref_sum)
    assert fused_calls == []


def test_gpu_dispatch() -> None:
    """On CUDA the fused kernel runs only where the unfused GEMV is the fma kernel (the
    table's measured configs), with that config, and only within the register budget;
    FP8 weights never get here (float8 is not an eligible dtype)."""
    from kernels.linear import choose_config, choose_gated_config
    from kernels.norm_linear import fused_config

    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    # Qwen2.5-1.5B at batch 1 and 2: qkv both, gate_up at M=1 (its M=2 config would spill).
    assert fused_config(1, 2048, 1536, bf16, cuda) == choose_config(1, 2048, 1536, bf16, cuda)
    assert fused_config(2, 2048, 1536, bf16, cuda) == choose_config(2, 2048, 1536, bf16, cuda)
    gated = fused_config(1, 17920, 1536, bf16, cuda, gated=True)
    assert gated == choose_gated_config(1, 17920, 1536, bf16, cuda)
    assert fused_config(2, 17920, 1536, bf16, cuda, gated=True) is None
    assert fused_config(4, 2048, 1536, bf16, cuda) is None  # 8 rows x 512 x 4 rows: spills
    assert fused_config(8, 2048, 1536, bf16, cuda) is None  # cuBLAS: unfused
    # Qwen2.5-7B at batch 1.
    assert fused_config(1, 4608, 3584, bf16, cuda) is not None
    assert fused_config(1, 37888, 3584, bf16, cuda, gated=True) is not None
    assert fused_config(1, 4608, 3584, torch.float32, cuda) is None  # the table is bf16/fp16


# Compiled (not interpreted) for an H200 (sm_90a, with the ptxas that ships with Triton):
# the interpreter accepts code the compiler refuses, and this machine has no GPU. The
# dispatch's fused configs for the 1.5B at M = 1 (qkv with its bias and K tail; gate_up
# without a residual, the first layer's case) and at M = 2 (qkv): compiled, and without
# register spills (the budget in kernels/norm_linear.py).
AOT_SCRIPT = """
import os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels._triton.linear import _gemv_fma_kernel as kernel

PTXAS = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "ptxas")
TYPES = {name: "*bf16" for name in ("x_ptr", "w_ptr", "b_ptr", "out_ptr", "ws_ptr", "r_ptr",
                                     "g_ptr", "h_ptr")}
TYPES.update({name: "i32" for name in ("M", "N", "K", "stride_xm", "stride_wn", "stride_om",
                                        "k_per_split", "stride_rm", "stride_hm")}, eps="fp32")

def build(rows, block_n, block_k, warps, gated, bias, add, even_k):
    consts = dict(ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k, USE_WS=False, HAS_BIAS=bias,
                  EVEN_K=even_k, VEC=8, GATED=gated, NORM=True, ADD_RESIDUAL=add)
    signature = {**TYPES, **{k: "constexpr" for k in consts}}
    constexprs = {(kernel.arg_names.index(k),): v for k, v in consts.items()}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": 1})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    report = subprocess.run([PTXAS, "--gpu-name", "sm_90a", "-v", f.name, "-o", os.devnull],
                            capture_output=True, text=True, check=True).stderr
    assert re.search(r"(?<![0-9])0 bytes spill stores", report), report

build(1, 1, 2048, 4, gated=False, bias=True, add=True, even_k=False)  # 1.5B qkv, M = 1
build(2, 2, 512, 4, gated=False, bias=True, add=True, even_k=True)  # 1.5B qkv, M = 2
build(1, 8, 256, 4, gated=True, bias=False, add=False, even_k=True)  # 1.5B gate_up, M = 1
print("compiled")
"""


def test_fused_kernel_compiles_for_hopper_without_spills() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", AOT_SCRIPT], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
