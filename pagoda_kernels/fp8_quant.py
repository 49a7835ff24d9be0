"""Dynamic per-token FP8 quantization of activations: the first half of the W8A8 scheme
of ``kernels.fp8_linear`` for the steps that run cuBLASLt's FP8 GEMM (``_scaled_mm``).

Each row of x gets ``scale = max(amax(|row|) / 448, 1 / (448 * 512))`` and is stored as
``clamp(row / scale, -448, 448)`` rounded to float8_e4m3fn. In plain torch that is a
float32 copy, abs, amax, two divisions, clamps and a cast, about ten passes over the
activations; the Triton kernel reads each row once (twice past ``ONE_PASS_MAX``
elements) and writes one byte per element and one float32 scale.
"""

from dataclasses import dataclass

import torch

from pagoda_kernels._backend import kernel_for

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# vLLM's floor on a dynamic activation scale: an all-zero row quantizes to zeros, not NaN.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


@dataclass(frozen=True, slots=True)
class Fp8Activations:
    """Activations already quantized by the scheme, as an op that produces them can write
    them (``kernels.rms_norm_fp8``, ``fused_add_rms_norm_fp8``, ``silu_and_mul_fp8``) for
    ``kernels.fp8_linear`` to take instead of x: ``data`` float8_e4m3fn [..., K] (unit
    stride along K), ``scale`` float32 [..., 1] (one a token), and ``dtype``, the dtype of
    the values they were quantized from (the linear's output dtype)."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def quantize_as_activations(x: torch.Tensor) -> Fp8Activations:
    """x [..., K] quantized per token (the reference), as ``Fp8Activations``."""
    rows, scale = quantize_per_token_ref(x.reshape(-1, x.shape[-1]))
    return Fp8Activations(rows.view(x.shape), scale.view(*x.shape[:-1], 1), x.dtype)


def quantize_per_token_ref(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [M, K] -> (float8_e4m3fn [M, K], float32 scales [M, 1])."""
    rows32 = rows.float()
    scale = (rows32.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    return (rows32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_per_token(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [M, K] (unit stride along K) -> (float8_e4m3fn [M, K] contiguous, float32
    scales [M, 1]): the scheme's activation quantization, one launch on the GPU."""
    if rows.dim() != 2:
        raise ValueError(f"quantize_per_token: rows must be [M, K], got {tuple(rows.shape)}")
    triton_ops = kernel_for("fp8_quant", rows)
    if triton_ops is not None and rows.shape[0] > 0 and rows.shape[1] > 0 and rows.stride(1) == 1:
        return triton_ops.quantize_per_token(rows)
    return quantize_per_token_ref(rows)
