"""Per-token FP8 activation quantization (``kernels.fp8_quant``): the Triton kernel under
the interpreter against the torch reference, on the one- and two-pass paths, with rows of
very different sizes, an all-zero row and values past the fp8 range."""

import pytest
import torch

from pagoda_kernels.fp8_quant import (
    FP8_DTYPE,
    MIN_SCALE,
    quantize_per_token,
    quantize_per_token_ref,
)


def rows(m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(k)
    x = torch.randn(m, k) * torch.logspace(-3, 3, m)[:, None]
    x[0] = 0.0  # all zero: the scale's floor, zeros out
    x[-1, k // 2] = 1e4  # one outlier sets the row's scale
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 96, 1000, 8192, 9000])
def test_triton_matches_reference(dtype: torch.dtype, k: int, monkeypatch) -> None:
    from pagoda_kernels._triton import fp8_quant

    calls = []
    original = fp8_quant.quantize_per_token
    monkeypatch.setattr(fp8_quant, "quantize_per_token",
                        lambda x: calls.append(x.shape) or original(x))  # fmt: skip
    x = rows(5, k, dtype)
    q, scale = quantize_per_token(x)
    assert calls, "the Triton kernel should run under the interpreter"
    q_ref, scale_ref = quantize_per_token_ref(x)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (5, 1)
    # amax and one division by 448 are exact operations: the scales agree to the bit.
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)
    assert scale[0].item() == pytest.approx(MIN_SCALE)
    assert not q[0].float().any()
    # Elementwise row / scale: at most a rounding boundary apart (one fp8 step, 2**-3).
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=2**-3, atol=0)
    assert (q.float() == q_ref.float()).float().mean() >= 0.999


def test_strided_rows_and_empty() -> None:
    x = rows(4, 200, torch.bfloat16)
    view = torch.cat([x, x], dim=1)[:, :200]  # row stride 400, unit stride along K
    q, scale = quantize_per_token(view)
    q_ref, scale_ref = quantize_per_token_ref(x)
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=2**-3, atol=0)
    q, scale = quantize_per_token(x[:0])
    assert q.shape == (0, 200) and scale.shape == (0, 1)
