"""Linear layer ``x @ weight.T + bias`` with a Triton skinny-GEMM path for decode.

``linear(x, weight, bias)`` has ``torch.nn.functional.linear``'s semantics (x [..., K],
weight [N, K] as stored in the model, optional bias [N], output in x's dtype, float32
accumulation). On CUDA it runs the Triton GEMV (``pagoda_kernels/_triton/linear.py``) when the
token count M is small and the (N, K, M) case is one the kernel was measured to win on
(``choose_config``); everything else, prefill included, goes to ``F.linear`` (cuBLAS).
The choice depends only on shapes, dtypes and strides, so a captured CUDA graph replays
exactly what was captured.
"""

import torch
import torch.nn.functional as F

from pagoda_kernels import _gemv_table
from pagoda_kernels._backend import kernel_for, num_sms
from pagoda_kernels._gemv_table import GemvConfig
from pagoda_kernels.activation import silu_and_mul, silu_and_mul_ref

# Largest token count the Triton path ever takes (the dot kernel pads M to 16).
MAX_M = 16
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_GPU_DTYPES = (torch.float16, torch.bfloat16)  # the table was measured in bf16


def linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear``; with ``out`` (contiguous, M x N elements) the result is written there."""
    if out is None:
        return F.linear(x, weight, bias)
    shape = (*x.shape[:-1], weight.shape[0])
    flat = out.view(-1, weight.shape[0])
    rows = x.reshape(-1, x.shape[-1])
    if bias is None:
        torch.mm(rows, weight.t(), out=flat)
    else:
        torch.addmm(bias, rows, weight.t(), out=flat)
    return out.view(shape)


def _eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Inputs the Triton kernel handles exactly like F.linear (else: F.linear)."""
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        return False
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or weight.device != x.device:
        return False
    if bias is not None and (
        bias.dim() != 1 or bias.shape[0] != weight.shape[0] or bias.dtype != x.dtype
        or bias.stride(0) != 1 or bias.device != x.device
    ):  # fmt: skip
        return False
    if weight.stride(1) != 1 or weight.shape[0] == 0 or weight.shape[1] == 0:
        return False
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return False  # no backward for the Triton path
    m = x.numel() // x.shape[-1]
    return 1 <= m <= MAX_M


def choose_config(
    m: int, n: int, k: int, dtype: torch.dtype, device: torch.device
) -> GemvConfig | None:
    """The Triton config for this case, or None for cuBLAS (see ``pagoda_kernels/_gemv_table.py``)."""
    if device.type != "cuda":  # the interpreter: always the kernel (that is what it tests)
        return _gemv_table.heuristic(m, n, k, num_sms(device))
    if dtype not in _GPU_DTYPES:
        return None
    return _gemv_table.lookup(m, n, k, torch.finfo(dtype).bits // 8)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``. ``out``: a contiguous tensor of x's dtype and device
    with M x N elements to write the result into (a tensor-parallel layer passes the
    all-reduce's staging buffer, saving a copy)."""
    if out is not None and (
        not out.is_contiguous() or out.dtype != x.dtype or out.device != x.device
        or out.numel() != x.numel() // max(x.shape[-1], 1) * weight.shape[0]
    ):  # fmt: skip
        raise ValueError("linear: out must be contiguous, of x's dtype and device, M x N")
    triton_ops = kernel_for("linear", x)
    if triton_ops is not None and _eligible(x, weight, bias):
        m = x.numel() // x.shape[-1]
        config = choose_config(m, weight.shape[0], weight.shape[1], x.dtype, x.device)
        if config is not None:
            return triton_ops.linear(x, weight, bias, config, out)
    return linear_ref(x, weight, bias, out)


def linear_silu_and_mul_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The gated MLP's first half: x [..., K], weight [2I, K] (gate rows, then up rows)
    -> silu(x @ gate.T) * (x @ up.T), [..., I]."""
    return silu_and_mul_ref(F.linear(x, weight))


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One kernel for the gate_up projection and SiLU-and-mul at small M (no gate_up
    round trip through memory); otherwise ``silu_and_mul(linear(x, weight))``. The fused
    path rounds only the final product to x's dtype (the unfused one rounds gate and up
    first), so the two agree to bf16 rounding, not bit for bit."""
    triton_ops = kernel_for("linear", x)
    if (
        triton_ops is not None
        and weight.dim() == 2
        and weight.shape[0] % 2 == 0
        and _eligible(x, weight, None)
    ):
        m = x.numel() // x.shape[-1]
        config = choose_gated_config(m, weight.shape[0], weight.shape[1], x.dtype, x.device)
        if config is not None:
            return triton_ops.linear_silu_and_mul(x, weight, config)
    return silu_and_mul(linear(x, weight))


def choose_gated_config(
    m: int, n2: int, k: int, dtype: torch.dtype, device: torch.device
) -> GemvConfig | None:
    """Config of the fused gate_up + SiLU-and-mul kernel (weight [n2, K]), or None."""
    if m > _gemv_table.FMA_MAX_M:
        return None
    if device.type != "cuda":
        config = _gemv_table.heuristic(m, n2 // 2, k, num_sms(device))
        if config.kind != "fma":
            return None
        return _gemv_table.GemvConfig("fma", config.block_n, config.block_k, 1, config.num_warps)
    if dtype not in _GPU_DTYPES:
        return None
    return _gemv_table.lookup_gated(m, n2, k)
