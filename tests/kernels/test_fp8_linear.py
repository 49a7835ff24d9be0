"""FP8 linear (``kernels.fp8_linear``): the Triton skinny GEMM (interpreter, tiny shapes)
and the float32 reference against the scheme in float64, and the reference against
torch's own scaled matmul."""

import pytest
import torch
from hopper_compile import run_compile_script

from pagoda_kernels import fp8_linear, fp8_linear_ref
from pagoda_kernels._float64 import fp8_linear64, rel_err
from pagoda_kernels._gemv_table import GemvConfig
from pagoda_kernels.fp8_linear import FP8_DTYPE, FP8_MAX, quantize_per_token_ref

# Against the scheme (x rounded to fp8 like the kernel): only float32 sums and, rarely, a
# division that lands an element on the other side of an fp8 rounding boundary differ.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]


def inputs(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    """x, per-channel-quantized weight and its scale (rows of very different sizes, as in
    real checkpoints), bias."""
    torch.manual_seed(seed)
    x = (torch.randn(m, k) * torch.logspace(-1, 1, m)[:, None]).to(dtype)
    weight = torch.randn(n, k) / k**0.5 * torch.logspace(-2, 0, n)[:, None]
    scale = weight.abs().amax(dim=1) / FP8_MAX
    quantized = (weight / scale[:, None]).to(FP8_DTYPE)
    b = torch.randn(n).to(dtype) if bias else None
    return x, quantized, scale, b


def unquantized(x, weight, scale, bias) -> torch.Tensor:
    """x @ W.T with the exact weights and x *not* quantized: what the scheme approximates."""
    out = x.double() @ (weight.double() * scale.double()[:, None]).T
    return out + bias.double() if bias is not None else out


@pytest.fixture
def triton_calls(monkeypatch: pytest.MonkeyPatch) -> list[GemvConfig]:
    from pagoda_kernels._triton import fp8_linear as triton_fp8

    calls: list[GemvConfig] = []
    original = triton_fp8.fp8_linear

    def spy(x, weight, weight_scale, bias, config, out=None):  # type: ignore[no-untyped-def]
        calls.append(config)
        return original(x, weight, weight_scale, bias, config, out)

    monkeypatch.setattr(triton_fp8, "fp8_linear", spy)
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 5])
@pytest.mark.parametrize(("n", "k", "bias"), [(40, 96, True), (33, 100, False)])
def test_triton_matches_float64(dtype, m, n, k, bias, triton_calls) -> None:
    x, weight, scale, b = inputs(m, n, k, dtype, bias, seed=m)
    out = fp8_linear(x, weight, scale, b)
    assert triton_calls, "the Triton kernel should run under the interpreter"
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out, fp8_linear64(x, weight, scale, b)) <= TOLERANCE[dtype]
    assert rel_err(out, fp8_linear_ref(x, weight, scale, b)) <= TOLERANCE[dtype]
    # The activation rounding costs a few percent against unquantized activations.
    assert rel_err(out, unquantized(x, weight, scale, b)) <= 0.05


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 4, 9, 40])
def test_reference_matches_float64(dtype, m) -> None:
    x, weight, scale, b = inputs(m, 24, 80, dtype, bias=True, seed=10 + m)
    out = fp8_linear_ref(x, weight, scale, b)
    assert out.dtype == dtype
    assert rel_err(out, fp8_linear64(x, weight, scale, b)) <= TOLERANCE[dtype]


def test_reference_matches_torch_scaled_mm() -> None:
    """torch 2.13's CPU ``_scaled_mm`` (row-wise scales) computes the same product."""
    x, weight, scale, _ = inputs(6, 32, 64, torch.float32, bias=False)
    x_q, x_scale = quantize_per_token_ref(x)
    peer = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=scale[None, :],
                            out_dtype=torch.float32)  # fmt: skip
    assert rel_err(fp8_linear_ref(x, weight, scale), peer) <= 1e-6


def test_activation_quantization() -> None:
    x = torch.randn(3, 50) * torch.tensor([[1e-3], [1.0], [0.0]])
    x_q, x_scale = quantize_per_token_ref(x)
    assert x_q.dtype == FP8_DTYPE and x_scale.shape == (3, 1)
    assert x_q[:2].float().abs().amax(dim=1).tolist() == [FP8_MAX, FP8_MAX]
    assert x_q[2].float().eq(0).all()  # an all-zero row: zeros, not NaN
    out = fp8_linear(x, *inputs(3, 8, 50, torch.float32, bias=False)[1:3])
    assert torch.isfinite(out).all() and out[2].eq(0).all()


# Every kind (in-kernel or separate activation quantization; fma or tensor-core dot) with
# 1/2/4/8 row buckets, split-K (workspace + reduce), K not a multiple of the tile, N not a
# multiple of the row block.
CONFIGS = [
    (3, GemvConfig("fma", 4, 32)),
    (2, GemvConfig("fma", 2, 16, split_k=3)),
    (7, GemvConfig("fma", 4, 64, split_k=2)),
    (1, GemvConfig("fma", 8, 128)),
    (5, GemvConfig("fmaq", 4, 32)),
    (1, GemvConfig("fmaq", 2, 16, split_k=3)),
    (8, GemvConfig("dot", 16, 32)),
    (1, GemvConfig("dot", 16, 16, split_k=3)),
    (4, GemvConfig("dotq", 32, 32, split_k=2)),
    (1, GemvConfig("dotq", 16, 64)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "config"), CONFIGS, ids=[f"{m}-{c.short()}" for m, c in CONFIGS])
def test_kernel_configs(dtype, m, config) -> None:
    from pagoda_kernels._triton import fp8_linear as triton_fp8

    x, weight, scale, b = inputs(m, 19, 70, dtype, bias=True, seed=3)
    out = torch.full((m, 19), float("nan"), dtype=dtype)
    triton_fp8.launch(x, weight, scale, b, out, config)
    assert rel_err(out, fp8_linear64(x, weight, scale, b)) <= TOLERANCE[dtype]
    again = torch.full_like(out, float("nan"))
    triton_fp8.launch(x, weight, scale, b, again, config)
    assert torch.equal(out, again)  # deterministic, split-K included


@pytest.mark.parametrize("m", [2, 12])  # the Triton kernel, then the reference's size
def test_into_out_and_leading_dims(m, triton_calls) -> None:
    x, weight, scale, b = inputs(m, 24, 48, torch.float32, bias=True, seed=m)
    buffer = torch.full((m * 24 + 8,), float("nan"))
    out = fp8_linear(x.view(m, 1, 48), weight, scale, b, out=buffer[: m * 24])
    assert out.shape == (m, 1, 24) and out.data_ptr() == buffer.data_ptr()
    assert rel_err(buffer[: m * 24].view(m, 24), fp8_linear64(x, weight, scale, b)) <= 1e-4
    assert buffer[m * 24 :].isnan().all()
    assert len(triton_calls) == (1 if m <= 8 else 0)
    with pytest.raises(ValueError, match="out must be"):
        fp8_linear(x, weight, scale, b, out=buffer[: m * 24 - 1])


def test_dispatch_takes_the_fp8_table(monkeypatch, triton_calls) -> None:
    """A shape in ``_gemv_table.FP8_TABLE`` runs its measured config up to its M (None:
    cuBLASLt, which on CPU means the reference); past it, and for shapes not listed, the
    heuristic."""
    from pagoda_kernels import _gemv_table
    from pagoda_kernels._backend import num_sms

    tuned = GemvConfig("dotq", 16, 32, split_k=2)
    monkeypatch.setattr(_gemv_table, "FP8_TABLE", {(24, 48): [(2, tuned), (4, None)]})
    for m in (1, 2, 3, 5):
        x, weight, scale, b = inputs(m, 24, 48, torch.bfloat16, bias=True, seed=m)
        out = fp8_linear(x, weight, scale, b)
        assert rel_err(out, fp8_linear64(x, weight, scale, b)) <= TOLERANCE[torch.bfloat16]
        if m == 3:
            assert torch.equal(out, fp8_linear_ref(x, weight, scale, b))
    cpu_sms = num_sms(torch.device("cpu"))
    assert triton_calls == [tuned, tuned, _gemv_table.fp8_heuristic(5, 24, 48, cpu_sms)]


def test_bad_operands_are_refused() -> None:
    x, weight, scale, _ = inputs(2, 8, 16, torch.float32, bias=False)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(x, weight.float(), scale)
    with pytest.raises(ValueError, match="weight_scale"):
        fp8_linear(x, weight, scale[:4])


# Compiled (not interpreted) for an H200 (sm_90, with the ptxas that ships with Triton): the
# interpreter accepts code the compiler refuses (layouts, fp8 wgmma operands), and this
# machine has no GPU. One config of each kind, with the split-K/odd-K/bias variants spread
# over them.
AOT_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagoda_kernels._triton import fp8_linear as f

ARGS = {"x_ptr": "*bf16", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32",
        "b_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32"}
INTS = ["M", "N", "K", "stride_xm", "stride_wn", "stride_om", "k_per_split"]

def build(kernel, types, consts, warps, stages):
    signature = {**types, **{k: "constexpr" for k in consts}}
    constexprs = {(kernel.arg_names.index(k),): v for k, v in consts.items()}
    src = ASTSource(kernel, signature, constexprs=constexprs)
    options = {"num_warps": warps, "num_stages": stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)

gemv = {**ARGS, **{i: "i32" for i in INTS}}
prequant = {**gemv, "x_ptr": "*fp8e4nv"}
build(f._fp8_gemv_kernel, gemv, dict(ROWS=8, BLOCK_N=4, BLOCK_K=512, USE_WS=False,
      HAS_BIAS=True, EVEN_K=True, VEC=16, PREQUANT=False), 4, 1)
build(f._fp8_gemv_kernel, prequant, dict(ROWS=2, BLOCK_N=2, BLOCK_K=1024, USE_WS=True,
      HAS_BIAS=False, EVEN_K=False, VEC=16, PREQUANT=True), 8, 1)
for quant, types in ((False, gemv), (True, prequant)):
    dot = build(f._fp8_gemv_dot_kernel, types, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256,
                USE_WS=quant, HAS_BIAS=not quant, EVEN_K=quant, PREQUANT=quant), 4, 3)
    assert "wgmma" in dot.asm["ptx"], "the dot kinds must run on Hopper's fp8 tensor cores"
print("compiled")
"""


def test_kernels_compile_for_hopper() -> None:
    done = run_compile_script(AOT_SCRIPT)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
