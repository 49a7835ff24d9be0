"""RMSNorm (with the residual add before it) fused into the projection after it, for
decode-sized steps.

In a decoder layer the input norm feeds the qkv projection and the post-attention norm
feeds gate_up (+ SiLU-and-mul). At a few tokens each of those norms is its own ~2 us launch
on a few KB; here the fma GEMV (``kernels/_triton/linear.py``, ``NORM``) does the add and
the norm itself while it streams the weight: one launch where there were two, which under
CUDA graphs is where small-batch decode time goes.

``rms_norm_linear(x, residual, norm_weight, eps, weight, bias)`` returns
``(linear(rms_norm(x + residual)), x + residual)`` (``residual`` None: no add, and the
returned residual is ``x``). The fused path runs where the unfused GEMV would be the
Triton fma kernel (same config, split-K off) and the fused variant's registers stay in
budget (``fused_config``); everything else, FP8 weights included (the model calls
``fp8_linear`` for those), is the unfused composition, as is every case when
``PAGODA_DISABLE_NORM_FUSION=1`` (to measure one against the other). The choice depends
only on shapes, dtypes, device and that variable, so CUDA graphs replay what they captured.

Numerics: the residual is exactly the unfused one (the sum rounded to the stream's dtype);
the fused projection computes ``rstd * sum(w * h * g)`` in float32 instead of rounding the
normed row to the model's dtype twice first, so it agrees with the unfused path to that
rounding (and is closer to the float64 truth), not bit for bit.
"""

import torch

from kernels import _gemv_table
from kernels._backend import _flag, kernel_for
from kernels._gemv_table import GemvConfig
from kernels.linear import (
    _eligible,
    choose_config,
    choose_gated_config,
    linear,
    linear_ref,
    linear_silu_and_mul,
    linear_silu_and_mul_ref,
)
from kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref

DISABLE_ENV = "PAGODA_DISABLE_NORM_FUSION"


def _norm(x, residual, norm_weight, eps, ref: bool):
    if residual is None:
        return (rms_norm_ref if ref else rms_norm)(x, norm_weight, eps), x
    return (fused_add_rms_norm_ref if ref else fused_add_rms_norm)(x, residual, norm_weight, eps)


def rms_norm_linear_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(rms_norm(x + residual), weight, bias), x + residual); x: [T, K]."""
    normed, summed = _norm(x, residual, norm_weight, eps, ref=True)
    return linear_ref(normed, weight, bias), summed


def rms_norm_linear_silu_and_mul_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu_and_mul(F.linear(rms_norm(x + residual), weight)), x + residual)."""
    normed, summed = _norm(x, residual, norm_weight, eps, ref=True)
    return linear_silu_and_mul_ref(normed, weight), summed


def _fusable(x, residual, norm_weight, weight, bias) -> bool:
    """Inputs the fused kernel takes exactly as the unfused ops do (before the config)."""
    if _flag(DISABLE_ENV) or x.dim() != 2 or x.stride(-1) != 1 or not _eligible(x, weight, bias):
        return False
    if (
        norm_weight.dim() != 1 or norm_weight.shape[0] != x.shape[1]
        or norm_weight.dtype != x.dtype or norm_weight.stride(0) != 1
        or norm_weight.device != x.device
    ):  # fmt: skip
        return False
    if residual is not None and (
        residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1
        or residual.device != x.device
    ):  # fmt: skip
        return False
    return not torch.is_grad_enabled() or not (
        norm_weight.requires_grad or (residual is not None and residual.requires_grad)
    )


# Register budget of the fused variant: per thread it holds a weight tile's elements and,
# per token row, x, residual and norm weight in the same layout, where the plain kernel
# holds one x. Compiled for sm_90a (ptxas -v), (1 + 3 x rows) x elements-per-thread up to
# 128 stayed spill-free (1.5B qkv M=1: 126 registers, gate_up M=1: 168); 1.5B gate_up at
# M=2 (224) spilled and 8 rows (208) spilled 2.5 KB. Past the budget: the unfused ops.
_MAX_FUSED_ELEMENTS = 128


def fused_config(
    m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, gated: bool = False
) -> GemvConfig | None:
    """The fma config the fused kernel runs for an [m, k] x [n, k] projection (``gated``:
    n = 2I rows of gate_up), or None where the op runs unfused (flag aside)."""
    if gated:
        config = choose_gated_config(m, n, k, dtype, device)
    else:
        config = choose_config(m, n, k, dtype, device)
    if config is None or config.kind != "fma" or m > _gemv_table.FMA_MAX_M:
        return None
    rows = 1 if m <= 1 else 2 if m <= 2 else 4 if m <= 4 else 8
    tile_n = config.block_n * (2 if gated else 1)
    per_thread = tile_n * config.block_k // (32 * config.num_warps)
    return config if (1 + 3 * rows) * per_thread <= _MAX_FUSED_ELEMENTS else None


def rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x + residual)), x + residual), fused at decode sizes (module
    docstring). Like ``fused_add_rms_norm``, the unfused path may store the sum into
    ``residual`` in place: use the returned pair, not the inputs."""
    triton_ops = kernel_for("linear", x)
    if triton_ops is not None and _fusable(x, residual, norm_weight, weight, bias):
        m, k = x.shape
        config = fused_config(m, weight.shape[0], k, x.dtype, x.device)
        if config is not None:
            return triton_ops.rms_norm_linear(x, residual, norm_weight, eps, weight, bias, config)
    normed, summed = _norm(x, residual, norm_weight, eps, ref=False)
    return linear(normed, weight, bias), summed


def rms_norm_linear_silu_and_mul(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu_and_mul(linear(rms_norm(x + residual), weight)), x + residual) for a gate_up
    weight [2I, K]: norm, projection and SiLU-and-mul in one launch at decode sizes."""
    triton_ops = kernel_for("linear", x)
    if (
        triton_ops is not None
        and weight.dim() == 2
        and weight.shape[0] % 2 == 0
        and _fusable(x, residual, norm_weight, weight, None)
    ):
        m, k = x.shape
        config = fused_config(m, weight.shape[0], k, x.dtype, x.device, gated=True)
        if config is not None:
            return triton_ops.rms_norm_linear(x, residual, norm_weight, eps, weight, None,
                                              config, gated=True)  # fmt: skip
    normed, summed = _norm(x, residual, norm_weight, eps, ref=False)
    return linear_silu_and_mul(normed, weight), summed
