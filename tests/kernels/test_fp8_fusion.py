"""FP8 activation quantization fused into the ops that produce the activations:
``rms_norm_fp8``, ``fused_add_rms_norm_fp8`` and ``silu_and_mul_fp8`` (Triton under the
interpreter), ``fp8_linear`` on pre-quantized input (``Fp8Activations``) on every path, and
``wants_fp8_input``, the rule that says when the model should ask for it.

The fused kernels must give exactly what quantizing the unfused op's output gives (the
same float32 math, the same rounding to the output dtype before the amax): checked bit for
bit against ``quantize_per_token`` of the Triton op, within an fp8 step of the torch
references (the interpreter rounds float32 -> bf16 toward zero, torch to nearest), and
dequantized against float64."""

import importlib

import pytest
import torch
from hopper_compile import run_compile_script

import pagoda_kernels as kernels
from pagoda_kernels import (
    Fp8Activations,
    fp8_linear,
    fp8_linear_ref,
    fused_add_rms_norm,
    fused_add_rms_norm_fp8,
    fused_add_rms_norm_fp8_ref,
    rms_norm,
    rms_norm_fp8,
    rms_norm_fp8_ref,
    silu_and_mul,
    silu_and_mul_fp8,
    silu_and_mul_fp8_ref,
    wants_fp8_input,
)
from pagoda_kernels._float64 import fp8_linear64, rel_err, rms_norm64, silu_and_mul64
from pagoda_kernels._gemv_table import GemvConfig
from pagoda_kernels.fp8_quant import FP8_DTYPE, FP8_MAX, MIN_SCALE, quantize_per_token

# silu's exp(-gate) overflows to inf for very negative gates (silu -> -0, as on the GPU).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Widths: tiny, odd, a real hidden size, past ONE_PASS_MAX (8192: SiLU-and-mul's two passes).
WIDTHS = [1, 96, 1000, 1536, 9000]


def rows(m: int, width: int, dtype: torch.dtype, seed: int, top: float = 2) -> torch.Tensor:
    """Rows of very different magnitudes (up to 10**top), the first all zero."""
    torch.manual_seed(seed)
    x = torch.randn(m, width) * torch.logspace(-2, top, m)[:, None]
    x[0] = 0.0
    return x.to(dtype)


def assert_same_quantization(fused: Fp8Activations, data: torch.Tensor, scale: torch.Tensor,
                             dtype: torch.dtype) -> None:  # fmt: skip
    assert fused.data.dtype == FP8_DTYPE and fused.scale.dtype == torch.float32
    assert fused.dtype == dtype and fused.scale.shape == (*fused.data.shape[:-1], 1)
    assert torch.equal(fused.scale.reshape(-1, 1), scale)
    assert torch.equal(fused.data.reshape(data.shape).view(torch.uint8), data.view(torch.uint8))


# Scales: the interpreter's and torch's roundings to the source dtype (twice for RMSNorm:
# the normed row, then times the weight) may differ by an ulp each.
SCALE_RTOL = {torch.bfloat16: 2**-5, torch.float16: 2**-8, torch.float32: 1e-6}


def assert_near_reference(fused: Fp8Activations, reference: Fp8Activations) -> None:
    """Scales a rounding or two of the source dtype apart; values at most one fp8 step
    apart, nearly all equal."""
    assert fused.dtype == reference.dtype and fused.data.shape == reference.data.shape
    torch.testing.assert_close(fused.scale, reference.scale, rtol=SCALE_RTOL[fused.dtype], atol=0)
    # (atol: e4m3's subnormal step, where a value one side of zero rounds to 0)
    torch.testing.assert_close(fused.data.float(), reference.data.float(), rtol=2**-3,
                               atol=2**-9)  # fmt: skip
    assert (fused.data.float() == reference.data.float()).float().mean() >= 0.9


def dequantized(quantized: Fp8Activations) -> torch.Tensor:
    return quantized.data.double() * quantized.scale.double()


def check_zero_row(quantized: Fp8Activations) -> None:
    assert quantized.scale.reshape(-1)[0].item() == pytest.approx(MIN_SCALE)
    assert not quantized.data.reshape(-1, quantized.data.shape[-1])[0].float().any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_rms_norm_fp8(dtype, width) -> None:
    x = rows(5, width, dtype, seed=width)
    weight = (1 + 0.1 * torch.randn(width)).to(dtype)
    fused = rms_norm_fp8(x, weight, 1e-6)
    assert_same_quantization(fused, *quantize_per_token(rms_norm(x, weight, 1e-6)), dtype)
    assert_near_reference(fused, rms_norm_fp8_ref(x, weight, 1e-6))
    check_zero_row(fused)
    assert rel_err(dequantized(fused), rms_norm64(x, weight, 1e-6)) <= 0.04


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_fused_add_rms_norm_fp8(dtype, width) -> None:
    x = rows(4, width, dtype, seed=width + 1).view(2, 2, width)  # leading dims kept
    residual = rows(4, width, dtype, seed=width + 2).view(2, 2, width)
    residual[0, 0] = -x[0, 0]  # sums to an all-zero row
    weight = (1 + 0.1 * torch.randn(width)).to(dtype)
    normed, expected_sum = fused_add_rms_norm(x, residual.clone(), weight, 1e-5)
    residual_in = residual.clone()
    fused, summed = fused_add_rms_norm_fp8(x, residual_in, weight, 1e-5)
    # The residual stream is exactly the unfused one, written in place.
    assert torch.equal(summed, expected_sum) and torch.equal(residual_in, expected_sum)
    assert fused.data.shape == x.shape and fused.scale.shape == (2, 2, 1)
    assert_same_quantization(fused, *quantize_per_token(normed.reshape(-1, width)), dtype)
    reference, reference_sum = fused_add_rms_norm_fp8_ref(x, residual, weight, 1e-5)
    torch.testing.assert_close(summed, reference_sum, rtol=2**-7, atol=0)
    assert_near_reference(fused, reference)
    check_zero_row(fused)
    expected = rms_norm64(x.double() + residual.double(), weight, 1e-5)
    assert rel_err(dequantized(fused), expected) <= 0.04


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_silu_and_mul_fp8(dtype, width) -> None:
    x = rows(3, 2 * width, dtype, seed=width + 3, top=1)  # products within fp16's range
    fused = silu_and_mul_fp8(x)
    assert_same_quantization(fused, *quantize_per_token(silu_and_mul(x)), dtype)
    assert_near_reference(fused, silu_and_mul_fp8_ref(x))
    check_zero_row(fused)
    assert rel_err(dequantized(fused), silu_and_mul64(x)) <= 0.04


def test_strided_and_empty_inputs() -> None:
    x = rows(4, 300, torch.bfloat16, seed=7)
    wide = torch.cat([x, x], dim=1)  # row stride 600: a gate_up view of unit column stride
    fused = silu_and_mul_fp8(wide[:, :400])
    assert_same_quantization(fused, *quantize_per_token(silu_and_mul(wide[:, :400])),
                             torch.bfloat16)  # fmt: skip
    weight = torch.ones(300, dtype=torch.bfloat16)
    fused = rms_norm_fp8(wide[:, :300], weight, 1e-6)
    assert_same_quantization(fused, *quantize_per_token(rms_norm(x, weight, 1e-6)),
                             torch.bfloat16)  # fmt: skip
    for empty in (rms_norm_fp8(x[:0], weight, 1e-6), silu_and_mul_fp8(x[:0])):
        assert empty.data.shape[0] == 0 and empty.scale.shape[0] == 0


def test_mixed_dtypes_round_to_the_promoted_output() -> None:
    """A float32 norm weight over bf16 rows: rms_norm returns float32, and the fused
    variant quantizes those float32 values (the reference's rule: promote)."""
    x = rows(3, 200, torch.bfloat16, seed=8)
    weight = 1 + 0.1 * torch.randn(200)
    fused = rms_norm_fp8(x, weight, 1e-6)
    assert fused.dtype == torch.float32
    assert_same_quantization(fused, *quantize_per_token(rms_norm(x, weight, 1e-6)),
                             torch.float32)  # fmt: skip


# -- fp8_linear on pre-quantized input ------------------------------------------------------


def linear_inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    x = (torch.randn(m, k) * torch.logspace(-1, 1, m)[:, None]).to(dtype)
    weight = torch.randn(n, k) / k**0.5
    scale = weight.abs().amax(dim=1) / FP8_MAX
    return x, (weight / scale[:, None]).to(FP8_DTYPE), scale, torch.randn(n).to(dtype)


def prequantized(x: torch.Tensor) -> Fp8Activations:
    data, scale = quantize_per_token(x.reshape(-1, x.shape[-1]))
    return Fp8Activations(data.view(x.shape), scale.view(*x.shape[:-1], 1), x.dtype)


@pytest.fixture
def separate_quantizations(monkeypatch) -> list[tuple[int, ...]]:
    """Shapes the FP8 GEMM quantized in a launch of its own (``quantize_per_token``)."""
    from pagoda_kernels._triton import fp8_linear as triton_fp8

    calls: list[tuple[int, ...]] = []
    original = triton_fp8.quantize_per_token
    monkeypatch.setattr(triton_fp8, "quantize_per_token",
                        lambda rows: calls.append(tuple(rows.shape)) or original(rows))  # fmt: skip
    return calls


KINDS = [GemvConfig("fma", 4, 32), GemvConfig("fmaq", 4, 32, split_k=2),
         GemvConfig("dot", 16, 32), GemvConfig("dotq", 16, 32, split_k=2)]  # fmt: skip


@pytest.mark.parametrize("config", KINDS, ids=lambda c: c.short())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_kinds_take_prequantized_input(config, dtype, separate_quantizations) -> None:
    """Every kind on Fp8Activations: no quantization launch, and the result of quantizing
    x itself (the ``q`` kinds: bit for bit; the in-kernel kinds run as their ``q`` twins,
    whose products and sums are the same)."""
    from pagoda_kernels._triton import fp8_linear as triton_fp8

    x, weight, scale, bias = linear_inputs(3, 40, 70, dtype, seed=1)
    own = triton_fp8.fp8_linear(x, weight, scale, bias, config)
    expected_quantizations = 1 if config.kind.endswith("q") else 0
    assert len(separate_quantizations) == expected_quantizations
    given = triton_fp8.fp8_linear(prequantized(x), weight, scale, bias, config)
    assert len(separate_quantizations) == expected_quantizations  # none more
    assert given.dtype == dtype and given.shape == (3, 40)
    if config.kind.endswith("q"):
        assert torch.equal(given, own)
    assert rel_err(given, own) <= 1e-2
    assert rel_err(given, fp8_linear64(x, weight, scale, bias)) <= 1e-2


def test_reference_and_scaled_mm_take_prequantized_input() -> None:
    """The reference (CPU) gives bit for bit what it gives on x; so does the cuBLASLt path
    (torch's ``_scaled_mm`` runs on CPU too), with ``out=`` and leading dims."""
    fp8_module = importlib.import_module("pagoda_kernels.fp8_linear")  # the module, not the op

    x, weight, scale, bias = linear_inputs(6, 32, 64, torch.bfloat16, seed=2)
    x3 = x.view(2, 3, 64)
    given = prequantized(x3)
    out = torch.full((6 * 32,), float("nan"), dtype=torch.bfloat16)
    result = fp8_linear_ref(given, weight, scale, bias, out=out)
    assert result.shape == (2, 3, 32) and result.data_ptr() == out.data_ptr()
    assert torch.equal(result, fp8_linear_ref(x3, weight, scale, bias))
    mm_given = fp8_module._scaled_mm(given, weight, scale, bias, None)
    assert torch.equal(mm_given, fp8_module._scaled_mm(x3, weight, scale, bias, None))
    assert rel_err(mm_given, fp8_linear64(x3, weight, scale, bias)) <= 1e-2


def test_bad_prequantized_input_is_refused() -> None:
    x, weight, scale, _ = linear_inputs(2, 8, 16, torch.bfloat16)
    given = prequantized(x)
    with pytest.raises(ValueError, match="Fp8Activations"):
        fp8_linear(Fp8Activations(given.data, given.scale.view(-1), x.dtype), weight, scale)
    with pytest.raises(ValueError, match="Fp8Activations"):
        fp8_linear(Fp8Activations(x, given.scale, x.dtype), weight, scale)


# -- the rule -----------------------------------------------------------------------------


def test_prequantized_path_is_taken_exactly_when_predicted(monkeypatch,
                                                           separate_quantizations) -> None:  # fmt: skip
    """``wants_fp8_input`` is True exactly for the steps whose FP8 GEMM would quantize x in
    a launch of its own (here the ``q`` kinds of the table; cuBLASLt on the GPU), and then
    fp8_linear given the fused ops' output launches no quantization; where it says False
    (an in-kernel kind, the reference) x itself goes in and no fp8 copy is made."""
    from pagoda_kernels import _gemv_table

    table = {(24, 48): [(1, GemvConfig("fma", 4, 16)), (2, GemvConfig("fmaq", 4, 16)),
                        (4, GemvConfig("dotq", 16, 16)), (8, GemvConfig("dot", 16, 16))]}  # fmt: skip
    monkeypatch.setattr(_gemv_table, "FP8_TABLE", table)
    x, weight, scale, bias = linear_inputs(8, 24, 48, torch.bfloat16, seed=3)
    norm_weight = torch.ones(48, dtype=torch.bfloat16)
    predicted = {m: wants_fp8_input(m, weight, torch.bfloat16, bias) for m in range(1, 10)}
    assert predicted == {1: False, 2: True, 3: True, 4: True, 5: False, 6: False, 7: False,
                         8: False, 9: False}  # fmt: skip
    for m, wanted in predicted.items():
        rows_in = torch.randn(m, 48).to(torch.bfloat16)
        separate_quantizations.clear()
        if wanted:
            given = rms_norm_fp8(rows_in, norm_weight, 1e-6)
            out = fp8_linear(given, weight, scale, bias)
            assert separate_quantizations == []
        else:
            out = fp8_linear(rms_norm(rows_in, norm_weight, 1e-6), weight, scale, bias)
        expected = fp8_linear(rms_norm(rows_in, norm_weight, 1e-6), weight, scale, bias)
        assert rel_err(out, expected) <= 1e-2
    # float32 activations keep to the fma kinds (fmaq still counts), any dtype on CPU
    # without Triton: the reference, which takes x.
    assert wants_fp8_input(2, weight, torch.float32)
    assert not wants_fp8_input(4, weight, torch.float32)  # dotq is refused: heuristic fma
    monkeypatch.setenv("PAGODA_DISABLE_TRITON", "1")
    assert not any(wants_fp8_input(m, weight, torch.bfloat16, bias) for m in range(0, 20))


def test_cpu_without_triton_falls_back_to_the_references(monkeypatch) -> None:
    monkeypatch.setenv("PAGODA_DISABLE_TRITON", "1")
    x = rows(3, 64, torch.bfloat16, seed=9)
    residual = rows(3, 64, torch.bfloat16, seed=10)
    weight = (1 + 0.1 * torch.randn(64)).to(torch.bfloat16)
    for fused, reference in (
        (rms_norm_fp8(x, weight, 1e-6), rms_norm_fp8_ref(x, weight, 1e-6)),
        (fused_add_rms_norm_fp8(x, residual, weight, 1e-6)[0],
         fused_add_rms_norm_fp8_ref(x, residual, weight, 1e-6)[0]),
        (silu_and_mul_fp8(torch.cat([x, x], 1)), silu_and_mul_fp8_ref(torch.cat([x, x], 1))),
    ):  # fmt: skip
        assert torch.equal(fused.scale, reference.scale)
        assert torch.equal(fused.data.view(torch.uint8), reference.data.view(torch.uint8))
    _, fp8_weight, scale, bias = linear_inputs(3, 16, 64, torch.bfloat16)
    given = kernels.rms_norm_fp8(x, weight, 1e-6)
    assert torch.equal(fp8_linear(given, fp8_weight, scale, bias),
                       fp8_linear_ref(rms_norm(x, weight, 1e-6), fp8_weight, scale, bias))  # fmt: skip


# Compiled (not interpreted) for an H200 with Triton's bundled ptxas, launched with PDL as
# the engine launches them: the model's shapes (7B hidden 3584 in one pass; intermediate
# 18944 in two passes, 8960 of the 1.5B too), bf16 in, e4m3 out. Prints registers and
# spills (the rows live in registers).
AOT_SCRIPT = r"""
import re
import subprocess
import tempfile
from pathlib import Path

import triton
import triton.language as tl
import triton.language.target_info as target_info
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagoda_kernels._triton import activation, rms_norm

PTXAS = str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas")
target = GPUTarget("cuda", 90, 32)
def current_target():  # what an H200's driver would report
    return target
current_target.__triton_builtin__ = True
target_info.current_target = current_target

def build(kernel, types, consts, warps):
    signature = {**types, **{k: "constexpr" for k in consts}}
    constexprs = {(kernel.arg_names.index(k),): v for k, v in consts.items()}
    src = ASTSource(kernel, signature, constexprs=constexprs)
    compiled = triton.compile(src, target=target,
                              options={"num_warps": warps, "launch_pdl": True})
    ptx = compiled.asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "e4m3" in ptx, kernel.fn.__name__
    with tempfile.TemporaryDirectory() as folder:  # ptxas -v: registers and spills
        (Path(folder) / "k.ptx").write_text(ptx)
        report = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", "k.ptx", "-o", "k.o"],
                                cwd=folder, capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", report).group(1)
    spills = re.search(r"(\d+) bytes spill stores", report).group(1)
    print(kernel.fn.__name__, consts, "registers", registers, "spills", spills)

norm = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16",
        "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "summed_ptr": "*bf16", "stride_x": "i32",
        "stride_r": "i32", "stride_q": "i32", "stride_s": "i32", "eps": "fp32"}
for hidden, block, warps, add in ((3584, 4096, 8, True), (1536, 2048, 4, False)):
    build(rms_norm._rms_norm_fp8_kernel, norm, dict(HIDDEN=hidden, BLOCK=block,
          ADD_RESIDUAL=add, OUT_DTYPE=tl.bfloat16), warps)
silu = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "stride_x": "i32",
        "stride_q": "i32", "width": "i32"}
for block, warps, one_pass in ((8192, 8, False), (8192, 8, True), (256, 1, True)):
    build(activation._silu_and_mul_fp8_kernel, silu, dict(BLOCK=block, ONE_PASS=one_pass),
          warps)
print("compiled")
"""


def test_fused_kernels_compile_for_hopper() -> None:
    done = run_compile_script(AOT_SCRIPT)
    print(done.stdout)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
    assert done.stdout.count("spills 0") == 5, done.stdout  # no kernel spills
