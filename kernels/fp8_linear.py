"""FP8 linear: ``x @ (weight * weight_scale).T + bias`` with float8_e4m3fn weights, one
float32 scale per output channel, and activations quantized per token at run time.

The numerics are vLLM's "fp8" scheme (W8A8, dynamic per-token activation scales), the same
on every path: each row of x gets ``scale = max(amax(|row|) / 448, 1 / (448 * 512))`` and is
rounded to float8_e4m3fn as ``row / scale`` (clamped to +-448); the fp8 x fp8 products are
accumulated in float32 and multiplied by ``x_scale[m] * weight_scale[n]``; the bias (in x's
dtype) is added and the result cast to x's dtype.

Three implementations of that one signature, chosen by shapes, dtypes and device only (so a
captured CUDA graph replays what was captured):

- the Triton skinny GEMM (``kernels/_triton/fp8_linear.py``) for decode-sized steps
  (M <= ``MAX_M``): a weight stream of half the bf16 bytes, fma or tensor-core kernels,
  the config from ``_gemv_table.lookup_fp8`` (H200-measured table, heuristic fallback);
- ``torch._scaled_mm`` (cuBLASLt, FP8 tensor cores, row-wise scales) on CUDA for larger M
  with bf16/fp16 activations and N, K multiples of 16, its activations quantized by one
  Triton launch (``kernels.fp8_quant``);
- ``fp8_linear_ref``, plain torch in float32 (dequantized fp8 operands, which multiply
  exactly), everywhere else: CPU, float32 activations, odd shapes.
"""

import torch

from kernels import _gemv_table
from kernels._backend import kernel_for, num_sms
from kernels._gemv_table import FMA_MAX_M, GemvConfig
from kernels.fp8_quant import (  # noqa: F401 (the scheme's constants, re-exported)
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    quantize_per_token,
    quantize_per_token_ref,
)

# Largest token count the Triton kernel takes (its fma loop keeps one accumulator per row).
# Above it the step is compute-bound enough for cuBLASLt's FP8 tensor cores.
MAX_M = FMA_MAX_M


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
           out: torch.Tensor | None) -> None:  # fmt: skip
    if weight.dtype != FP8_DTYPE or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"fp8_linear: weight must be float8_e4m3fn [N, K] with K = x.shape[-1]; got "
            f"{weight.dtype} {tuple(weight.shape)} for x {tuple(x.shape)}"
        )
    if weight_scale.dtype != torch.float32 or weight_scale.shape != (weight.shape[0],):
        raise ValueError("fp8_linear: weight_scale must be float32 [N]")
    if out is not None and (
        not out.is_contiguous() or out.dtype != x.dtype or out.device != x.device
        or out.numel() != x.numel() // max(x.shape[-1], 1) * weight.shape[0]
    ):  # fmt: skip
        raise ValueError("fp8_linear: out must be contiguous, of x's dtype and device, M x N")


def _finish(result: torch.Tensor, x: torch.Tensor, n: int, out: torch.Tensor | None):
    shape = (*x.shape[:-1], n)
    if out is None:
        return result.view(shape)
    out.view(-1, n).copy_(result)
    return out.view(shape)


def fp8_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The scheme in plain torch, float32 math (see the module docstring)."""
    _check(x, weight, weight_scale, out)
    rows = x.reshape(-1, x.shape[-1])
    x_q, x_scale = quantize_per_token_ref(rows)
    acc = torch.mm(x_q.float(), weight.float().t())
    result = acc * x_scale * weight_scale[None, :]
    if bias is not None:
        result += bias.float()
    return _finish(result.to(x.dtype), x, weight.shape[0], out)


def use_scaled_mm(n: int, k: int, dtype: torch.dtype, device_type: str) -> bool:
    """Whether cuBLASLt's FP8 GEMM can take a step the Triton kernel does not (M past
    ``MAX_M``, or Triton disabled): CUDA, bf16 or fp16 activations (row-wise scaling writes
    bf16; fp16 is cast from it, a rounding far below fp8's), N and K multiples of 16 (its
    alignment rule). float32 activations keep the exact reference."""
    return (device_type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and n % 16 == 0 and k % 16 == 0)  # fmt: skip


def choose_config(m: int, n: int, k: int, device: torch.device,
                  dtype: torch.dtype = torch.bfloat16) -> GemvConfig | None:  # fmt: skip
    """The Triton config for this case (``_gemv_table.lookup_fp8``: the H200-measured
    FP8 table, else its heuristic), or None (cuBLASLt, where the table measured it faster
    or M > MAX_M; else the reference). float32 activations get the fma kinds only (float32
    sums, as the reference)."""
    if not 1 <= m <= MAX_M:
        return None
    return _gemv_table.lookup_fp8(m, n, k, num_sms(device), dtype != torch.float32)


def _eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Inputs the Triton kernel takes exactly as the reference does."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    if weight.stride(1) != 1 or weight.shape[0] == 0 or weight.shape[1] == 0:
        return False
    if weight.device != x.device:
        return False
    return bias is None or (bias.dim() == 1 and bias.stride(0) == 1 and bias.dtype == x.dtype)


def _scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    rows = x.reshape(-1, x.shape[-1])
    x_q, x_scale = quantize_per_token(rows)
    result = torch._scaled_mm(
        x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale[None, :],
        out_dtype=torch.bfloat16,
    ).to(x.dtype)
    if bias is not None:
        result += bias
    return _finish(result, x, weight.shape[0], out)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32), weight float8_e4m3fn [N, K], weight_scale float32 [N],
    bias [N] in x's dtype -> [..., N] in x's dtype. ``out``: a contiguous tensor of x's
    dtype with M x N elements to write into (a tensor-parallel all-reduce's staging)."""
    _check(x, weight, weight_scale, out)
    n, k = weight.shape
    m = x.numel() // max(k, 1)
    triton_ops = kernel_for("fp8_linear", x)
    if triton_ops is not None and _eligible(x, weight, bias):
        config = choose_config(m, n, k, x.device, x.dtype)
        if config is not None:
            return triton_ops.fp8_linear(x, weight, weight_scale, bias, config, out)
    if x.is_cuda and m > 0 and use_scaled_mm(n, k, x.dtype, x.device.type):
        return _scaled_mm(x, weight, weight_scale, bias, out)
    return fp8_linear_ref(x, weight, weight_scale, bias, out)
