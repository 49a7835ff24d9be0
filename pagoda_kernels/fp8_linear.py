"""FP8 linear: ``x @ (weight * weight_scale).T + bias`` with float8_e4m3fn weights, one
float32 scale per output channel, and activations quantized per token at run time.

The numerics are vLLM's "fp8" scheme (W8A8, dynamic per-token activation scales), the same
on every path: each row of x gets ``scale = max(amax(|row|) / 448, 1 / (448 * 512))`` and is
rounded to float8_e4m3fn as ``row / scale`` (clamped to +-448); the fp8 x fp8 products are
accumulated in float32 and multiplied by ``x_scale[m] * weight_scale[n]``; the bias (in x's
dtype) is added and the result cast to x's dtype.

Three implementations of that one signature, chosen by shapes, dtypes and device only (so a
captured CUDA graph replays what was captured):

- the Triton skinny GEMM (``pagoda_kernels/_triton/fp8_linear.py``) for decode-sized steps
  (M <= ``MAX_M``): a weight stream of half the bf16 bytes, fma or tensor-core kernels,
  the config from ``_gemv_table.lookup_fp8`` (H200-measured table, heuristic fallback);
- ``torch._scaled_mm`` (cuBLASLt, FP8 tensor cores, row-wise scales) on CUDA for larger M
  with bf16/fp16 activations and N, K multiples of 16, its activations quantized by one
  Triton launch (``kernels.fp8_quant``);
- ``fp8_linear_ref``, plain torch in float32 (dequantized fp8 operands, which multiply
  exactly), everywhere else: CPU, float32 activations, odd shapes.

x may also arrive quantized already (``Fp8Activations``, written by the RMSNorm or
SiLU-and-mul launch that produced it): the paths that would quantize it in a launch of
their own (cuBLASLt, the ``fmaq``/``dotq`` kinds) then skip it; ``wants_fp8_input`` tells
the model when that is the case.
"""

import torch

from pagoda_kernels import _gemv_table
from pagoda_kernels._backend import kernel_for, num_sms
from pagoda_kernels._gemv_table import FMA_MAX_M, GemvConfig
from pagoda_kernels.fp8_quant import (  # noqa: F401 (the scheme's constants, re-exported)
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    Fp8Activations,
    quantize_per_token,
    quantize_per_token_ref,
)

# Largest token count the Triton kernel takes (its fma loop keeps one accumulator per row).
# Above it the step is compute-bound enough for cuBLASLt's FP8 tensor cores.
MAX_M = FMA_MAX_M


def _check(x: torch.Tensor | Fp8Activations, weight: torch.Tensor,
           weight_scale: torch.Tensor, out: torch.Tensor | None) -> None:  # fmt: skip
    rows = x.data if isinstance(x, Fp8Activations) else x
    if weight.dtype != FP8_DTYPE or weight.dim() != 2 or rows.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"fp8_linear: weight must be float8_e4m3fn [N, K] with K = x.shape[-1]; got "
            f"{weight.dtype} {tuple(weight.shape)} for x {tuple(rows.shape)}"
        )
    if weight_scale.dtype != torch.float32 or weight_scale.shape != (weight.shape[0],):
        raise ValueError("fp8_linear: weight_scale must be float32 [N]")
    if isinstance(x, Fp8Activations) and (
        x.data.dtype != FP8_DTYPE or x.scale.dtype != torch.float32
        or x.scale.shape != (*x.data.shape[:-1], 1)
    ):  # fmt: skip
        raise ValueError("fp8_linear: Fp8Activations must be float8_e4m3fn [..., K] values "
                         "with float32 [..., 1] scales")  # fmt: skip
    if out is not None and (
        not out.is_contiguous() or out.dtype != x.dtype or out.device != rows.device
        or out.numel() != rows.numel() // max(rows.shape[-1], 1) * weight.shape[0]
    ):  # fmt: skip
        raise ValueError("fp8_linear: out must be contiguous, of x's dtype and device, M x N")


def _quantized_rows(x: torch.Tensor | Fp8Activations) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 rows [M, K], float32 scales [M, 1]): x's own if pre-quantized, else the
    reference's quantization of x."""
    if isinstance(x, Fp8Activations):
        return x.data.reshape(-1, x.data.shape[-1]), x.scale.reshape(-1, 1)
    return quantize_per_token_ref(x.reshape(-1, x.shape[-1]))


def _finish(result: torch.Tensor, x: torch.Tensor | Fp8Activations, n: int,
            out: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    rows = x.data if isinstance(x, Fp8Activations) else x
    shape = (*rows.shape[:-1], n)
    if out is None:
        return result.view(shape)
    out.view(-1, n).copy_(result)
    return out.view(shape)


def fp8_linear_ref(
    x: torch.Tensor | Fp8Activations,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The scheme in plain torch, float32 math (see the module docstring)."""
    _check(x, weight, weight_scale, out)
    x_q, x_scale = _quantized_rows(x)
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


def _eligible(dtype: torch.dtype, device: torch.device, weight: torch.Tensor,
              bias: torch.Tensor | None) -> bool:  # fmt: skip
    """Inputs the Triton kernel takes exactly as the reference does."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    if weight.stride(1) != 1 or weight.shape[0] == 0 or weight.shape[1] == 0:
        return False
    if weight.device != device:
        return False
    return bias is None or (bias.dim() == 1 and bias.stride(0) == 1 and bias.dtype == dtype)


def _route(m: int, dtype: torch.dtype, rows: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None) -> GemvConfig | str:  # fmt: skip
    """The path an [m, K] input of ``dtype`` on ``rows``' device takes: a Triton config,
    "scaled_mm" or "reference". Shapes, dtypes and the device only."""
    n, k = weight.shape
    if kernel_for("fp8_linear", rows) is not None and _eligible(dtype, rows.device, weight, bias):
        config = choose_config(m, n, k, rows.device, dtype)
        if config is not None:
            return config
    if rows.is_cuda and m > 0 and use_scaled_mm(n, k, dtype, rows.device.type):
        return "scaled_mm"
    return "reference"


def wants_fp8_input(m: int, weight: torch.Tensor, dtype: torch.dtype,
                    bias: torch.Tensor | None = None) -> bool:  # fmt: skip
    """Whether ``fp8_linear`` on m tokens of ``dtype`` (on ``weight``'s device) would
    quantize them in a launch of its own (cuBLASLt; the ``fmaq``/``dotq`` Triton kinds):
    then the op producing them should write ``Fp8Activations`` instead (the ``_fp8``
    variants of RMSNorm and SiLU-and-mul), which saves that launch and a pass over x.
    False where x is quantized inside the GEMM (the ``fma``/``dot`` kinds: batch 1 on most
    shapes) or by the reference (CPU): those keep taking x itself. Decided by shapes,
    dtypes and the device as the dispatch is, so a CUDA graph replays what it captured;
    ``fp8_linear`` takes either form on every path, whatever this says."""
    route = _route(m, dtype, weight, weight, bias)
    return route == "scaled_mm" or (isinstance(route, GemvConfig) and route.kind.endswith("q"))


def _scaled_mm(x: torch.Tensor | Fp8Activations, weight: torch.Tensor,
               weight_scale: torch.Tensor, bias: torch.Tensor | None,
               out: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    if isinstance(x, Fp8Activations):
        x_q, x_scale = _quantized_rows(x)
    else:
        x_q, x_scale = quantize_per_token(x.reshape(-1, x.shape[-1]))
    result = torch._scaled_mm(
        x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale[None, :],
        out_dtype=torch.bfloat16,
    ).to(x.dtype)
    if bias is not None:
        result += bias
    return _finish(result, x, weight.shape[0], out)


def fp8_linear(
    x: torch.Tensor | Fp8Activations,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32), weight float8_e4m3fn [N, K], weight_scale float32 [N],
    bias [N] in x's dtype -> [..., N] in x's dtype. ``out``: a contiguous tensor of x's
    dtype with M x N elements to write into (a tensor-parallel all-reduce's staging).
    x may come pre-quantized (``Fp8Activations``, see ``wants_fp8_input``): every path
    then uses its values and scales instead of quantizing (the fma/dot kinds run as
    their fmaq/dotq twins, same tiling), and the result is what x's own quantization
    would give."""
    _check(x, weight, weight_scale, out)
    rows = x.data if isinstance(x, Fp8Activations) else x
    n, k = weight.shape
    m = rows.numel() // max(k, 1)
    route = _route(m, x.dtype, rows, weight, bias)
    if isinstance(route, GemvConfig):
        triton_ops = kernel_for("fp8_linear", rows)
        return triton_ops.fp8_linear(x, weight, weight_scale, bias, route, out)
    if route == "scaled_mm":
        return _scaled_mm(x, weight, weight_scale, bias, out)
    return fp8_linear_ref(x, weight, weight_scale, bias, out)
