"""Skinny GEMM (``kernels.linear``) and fused gate_up + SiLU-and-mul: the Triton kernels
(interpreter, tiny shapes) against float64 and F.linear, and the dispatch rules."""

import pytest
import torch
import torch.nn.functional as F

from pagoda_kernels import _gemv_table, linear, linear_ref, linear_silu_and_mul
from pagoda_kernels._float64 import rel_err, silu_and_mul64
from pagoda_kernels._gemv_table import GemvConfig
from pagoda_kernels.linear import _eligible, choose_config, choose_gated_config

TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]


def inputs(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    torch.manual_seed(seed)
    x = torch.randn(m, k).to(dtype)
    weight = (torch.randn(n, k) / k**0.5).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    return x, weight, b


def truth(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out + bias.double() if bias is not None else out


@pytest.fixture
def triton_calls(monkeypatch: pytest.MonkeyPatch) -> list[GemvConfig]:
    """Configs the Triton path ran with (empty: the op fell back to F.linear)."""
    from pagoda_kernels._triton import linear as triton_linear

    calls: list[GemvConfig] = []
    original = triton_linear.linear

    def spy(x, weight, bias, config, out=None):  # type: ignore[no-untyped-def]
        calls.append(config)
        return original(x, weight, bias, config, out)

    monkeypatch.setattr(triton_linear, "linear", spy)
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize(("n", "k", "bias"), [(40, 96, True), (33, 100, False)])
def test_linear_matches_float64(
    dtype: torch.dtype, m: int, n: int, k: int, bias: bool, triton_calls: list
) -> None:
    x, weight, b = inputs(m, n, k, dtype, bias, seed=m)
    out = linear(x, weight, b)
    assert triton_calls, "the Triton kernel should run under the interpreter"
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out, truth(x, weight, b)) <= TOLERANCE[dtype]
    assert rel_err(out, linear_ref(x, weight, b)) <= TOLERANCE[dtype]


# Every code path: fma with 1/2/4/8 row buckets, split-K (workspace + reduce kernel), K not
# a multiple of the tile, N not a multiple of the row block; dot with M padded to 16.
CONFIGS = [
    (3, GemvConfig("fma", 4, 32)),
    (2, GemvConfig("fma", 2, 16, split_k=3)),
    (7, GemvConfig("fma", 4, 64, split_k=2)),
    (1, GemvConfig("dot", 16, 32, num_stages=2)),
    (5, GemvConfig("dot", 16, 16, split_k=4, num_stages=2)),
    (16, GemvConfig("dot", 32, 32, split_k=2)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "config"), CONFIGS, ids=[c.short() for _, c in CONFIGS])
def test_kernel_configs(dtype: torch.dtype, m: int, config: GemvConfig) -> None:
    from pagoda_kernels._triton import linear as triton_linear

    x, weight, b = inputs(m, 19, 70, dtype, bias=True, seed=3)
    out = torch.full((m, 19), float("nan"), dtype=dtype)
    triton_linear.launch(x, weight, b, out, config)
    assert rel_err(out, truth(x, weight, b)) <= TOLERANCE[dtype]
    again = torch.full_like(out, float("nan"))
    triton_linear.launch(x, weight, b, again, config)
    assert torch.equal(out, again)  # deterministic, split-K included


def test_leading_dims_and_strided_x(triton_calls: list) -> None:
    x, weight, b = inputs(3, 24, 48, torch.float32, bias=True)
    out = linear(x.view(3, 1, 48), weight, b)
    assert out.shape == (3, 1, 24)
    assert rel_err(out.view(3, 24), truth(x, weight, b)) <= 1e-5
    wide = torch.randn(2, 96)
    strided = wide[:, ::2]  # stride 2 along K: copied to unit stride first
    assert rel_err(linear(strided, weight), truth(strided, weight, None)) <= 1e-5
    assert len(triton_calls) == 2


@pytest.mark.parametrize("m", [2, 40])  # the Triton kernel, then F.linear's size
@pytest.mark.parametrize("bias", [False, True])
def test_linear_into_out(m: int, bias: bool, triton_calls: list) -> None:
    """``out=``: the result lands in the given buffer (a tensor-parallel all-reduce's
    staging memory), viewed in x's leading shape."""
    x, weight, b = inputs(m, 24, 48, torch.float32, bias=bias, seed=m)
    buffer = torch.full((m * 24 + 8,), float("nan"))
    out = linear(x.view(m, 1, 48), weight, b, out=buffer[: m * 24])
    assert out.shape == (m, 1, 24) and out.data_ptr() == buffer.data_ptr()
    assert rel_err(buffer[: m * 24].view(m, 24), truth(x, weight, b)) <= 1e-5
    assert buffer[m * 24 :].isnan().all()
    assert len(triton_calls) == (1 if m <= 16 else 0)
    with pytest.raises(ValueError, match="out must be"):
        linear(x, weight, b, out=buffer[: m * 24 - 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3])
def test_linear_silu_and_mul(dtype: torch.dtype, m: int) -> None:
    x, weight, _ = inputs(m, 2 * 20, 64, dtype, bias=False, seed=7)
    out = linear_silu_and_mul(x, weight)
    assert out.shape == (m, 20)
    assert rel_err(out, silu_and_mul64(truth(x, weight, None))) <= TOLERANCE[dtype]


def test_fallbacks_to_f_linear(triton_calls: list, monkeypatch: pytest.MonkeyPatch) -> None:
    x, weight, b = inputs(17, 24, 48, torch.float32, bias=True)
    assert torch.equal(linear(x, weight, b), F.linear(x, weight, b))  # M > MAX_M
    x1 = x[:1]
    col_major = weight.t().contiguous().t()  # weight not K-contiguous
    assert torch.equal(linear(x1, col_major, b), F.linear(x1, col_major, b))
    grad_x = x1.clone().requires_grad_()
    out = linear(grad_x, weight, b)  # autograd needs the reference
    assert out.grad_fn is not None
    assert triton_calls == []
    assert not _eligible(x1, weight.to(torch.bfloat16), None)  # dtype mismatch
    assert not _eligible(x1, weight, b.to(torch.bfloat16))
    assert not _eligible(x1[:, :40], weight, None)  # K mismatch
    assert not _eligible(x[:0], weight, None)  # M = 0
    monkeypatch.setenv("PAGODA_DISABLE_TRITON", "1")
    assert torch.equal(linear(x1, weight, b), F.linear(x1, weight, b))
    monkeypatch.delenv("PAGODA_DISABLE_TRITON")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert torch.equal(linear(x1, weight, b), F.linear(x1, weight, b))
    assert triton_calls == []


def test_gpu_dispatch_table() -> None:
    """The CUDA choice is a pure function of (M, N, K, dtype): Triton where measured to win."""
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    assert choose_config(1, 1536, 8960, bf16, cuda) == _gemv_table.TABLE[(1536, 8960)][0][1]
    assert choose_config(2, 2048, 1536, bf16, cuda) is not None
    assert choose_config(3, 2048, 1536, bf16, cuda) == choose_config(4, 2048, 1536, bf16, cuda)
    assert choose_config(16, 1536, 8960, bf16, cuda) is None  # cuBLAS wins there
    assert choose_config(8, 17920, 1536, bf16, cuda) is None
    assert choose_config(16, 17920, 1536, bf16, cuda).kind == "dot"
    assert choose_config(1, 151936, 1536, bf16, cuda) is None  # LM head: cuBLAS
    assert choose_config(1, 1536, 8960, torch.float32, cuda) is None  # table is bf16/fp16
    assert choose_config(1, 3000, 2000, bf16, cuda) == _gemv_table.GENERIC_M1
    assert choose_config(2, 3000, 2000, bf16, cuda) is None
    assert choose_config(1, 256, 2000, bf16, cuda) is None  # outside the measured range
    assert choose_config(1, 2304, 3584, bf16, cuda) == _gemv_table.TABLE[(2304, 3584)][0][1]
    assert choose_gated_config(2, 18944, 3584, bf16, cuda) is not None  # 7B gate_up at TP=2
    assert choose_gated_config(1, 17920, 1536, bf16, cuda) is not None
    assert choose_gated_config(4, 17920, 1536, bf16, cuda) is None
    assert choose_gated_config(1, 1000, 1536, bf16, cuda) is None
    for entries in (*_gemv_table.TABLE.values(), *_gemv_table.GATED_TABLE.values()):
        bounds = [max_m for max_m, _ in entries]
        assert bounds == sorted(bounds) and bounds[-1] <= 16
        for max_m, config in entries:
            assert config is None or config.kind == "dot" or max_m <= _gemv_table.FMA_MAX_M
