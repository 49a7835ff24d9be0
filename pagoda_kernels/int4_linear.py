"""Int4 linear (W4A16): ``x @ W.T + bias`` with 4-bit weights dequantized on the fly.

The weight layout (what ``inference/quantization/int4.py`` repacks every checkpoint
format into at load):

- ``qweight`` int32 [N, ceil(K / 8)]: row n's codes along K, eight a word, code k in bits
  ``4 * (k % 8)`` of word ``k // 8`` (padding codes past K are never read);
- ``scales`` float32 [N, G] and ``zeros`` uint8 [N, G]: group g's scale and zero point
  (0..16: GPTQ's v1 zero 15 + 1 fits);
- the group of input k: ``k // group_size``, or ``g_idx[k]`` (int32 [K]) when given
  (GPTQ ``desc_act``); a per-channel scheme is one group of ``group_size = K``.

So ``W[n, k] = (code - zeros[n, g]) * scales[n, g]``, exact in float32 (a small integer
times the checkpoint's fp16/bf16 scale). Products are accumulated in float32 and the
result (plus bias, in x's dtype) cast to x's dtype.

Implementations of the one signature, chosen by shape and device only (no host syncs:
a CUDA graph captures them as they are):

- for decode-sized steps (M <= ``GEMV_MAX_M``) without act order, the Triton GEMVs
  (``pagoda_kernels/_triton/int4_linear.py``): the tensor-core GEMV (codes unpacked two a 32-bit
  op into the dot's first operand, x the second, the group scale applied to the partial
  sum), or at one row for small and long-K projections the word GEMV (float32
  multiply-adds); with act order (a g_idx) up to ``ACT_ORDER_GEMV_MAX_M`` rows, the first
  GEMV (one program a row);
- above that, with the model's shared scratch buffer: the projection dequantized into it
  and multiplied by cuBLAS; without one, the Triton GEMM (dequantizes [BLOCK_K, BLOCK_N]
  tiles to x's dtype into ``tl.dot``; float32 x: exact float32 products);
- ``int4_linear_ref``, plain torch in float32, everywhere else (CPU).
"""

import torch

from pagoda_kernels._backend import kernel_for

# Largest token count the GEMVs take. The tensor-core GEMV (no act order) costs about the
# same from 1 to 16 rows (on the H200 7B gate_up 50.6 us at 1 row, 50.9 at 4, 52.4 at 16;
# bf16's cuBLAS 72 us), below dequantizing into the scratch and cuBLAS (~2.5 bytes an
# element to dequantize plus bf16's own stream). The first GEMV (act order: a g_idx) is
# issue-bound and grows with the rows: it stops at 4.
GEMV_MAX_M = 16
ACT_ORDER_GEMV_MAX_M = 4


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
           group_size: int, g_idx: torch.Tensor | None) -> None:  # fmt: skip
    k = x.shape[-1]
    n = qweight.shape[0]
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or qweight.shape[1] != -(-k // 8):
        raise ValueError(f"int4_linear: qweight must be int32 [N, ceil(K / 8)] for K = "
                         f"{k}; got {qweight.dtype} {tuple(qweight.shape)}")  # fmt: skip
    if (scales.dtype != torch.float32 or zeros.dtype != torch.uint8 or scales.dim() != 2
            or scales.shape[0] != n or zeros.shape != scales.shape
            or not (qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous())):  # fmt: skip
        raise ValueError("int4_linear: scales must be float32 [N, G] and zeros uint8 [N, G], "
                         "contiguous like qweight")
    if g_idx is None and (group_size <= 0 or -(-k // group_size) > scales.shape[1]):
        raise ValueError(f"int4_linear: group_size {group_size} needs more than the "
                         f"{scales.shape[1]} groups given for K = {k}")  # fmt: skip
    if g_idx is not None and (g_idx.dtype != torch.int32 or g_idx.shape != (k,)):
        raise ValueError("int4_linear: g_idx must be int32 [K]")


def unpack_codes(qweight: torch.Tensor, k: int) -> torch.Tensor:
    """The codes of ``qweight`` as int32 [N, K] (0..15)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    codes = (qweight[:, :, None] >> shifts) & 0xF
    return codes.reshape(qweight.shape[0], -1)[:, :k]


def group_of_inputs(k: int, group_size: int, g_idx: torch.Tensor | None,
                    device: torch.device) -> torch.Tensor:  # fmt: skip
    """The group of every input column, int64 [K]."""
    if g_idx is not None:
        return g_idx.long()
    return torch.arange(k, device=device) // group_size


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, g_idx: torch.Tensor | None, k: int) -> torch.Tensor:  # fmt: skip
    """The float32 [N, K] weight the layout means."""
    groups = group_of_inputs(k, group_size, g_idx, qweight.device)
    codes = unpack_codes(qweight, k).float()
    return (codes - zeros[:, groups].float()) * scales[:, groups]


def int4_linear_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias)`` in float32 on the dequantized weight; x's dtype."""
    _check(x, qweight, scales, zeros, group_size, g_idx)
    weight = dequantize_int4(qweight, scales, zeros, group_size, g_idx, x.shape[-1])
    result = x.reshape(-1, x.shape[-1]).float() @ weight.T
    if bias is not None:
        result = result + bias.float()
    result = result.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])
    if out is None:
        return result
    out.view_as(result).copy_(result)
    return out


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """As ``int4_linear_ref``, through the Triton kernels where they run. ``scratch`` (x's
    dtype, at least N x K elements, on x's device): above ``GEMV_MAX_M`` rows the weight
    is dequantized into it and multiplied by cuBLAS (tensor cores at full rate for prefill
    and large batches); without it the Triton GEMM runs."""
    module = kernel_for("int4_linear", x)
    if module is None:
        return int4_linear_ref(x, qweight, scales, zeros, group_size, g_idx, bias, out)
    _check(x, qweight, scales, zeros, group_size, g_idx)
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    n = qweight.shape[0]
    dest = None if out is None else out.view(rows.shape[0], n)
    if dest is not None and not dest.is_contiguous():
        dest = None
    fast = module.words_eligible(group_size, scales.shape[1], g_idx)
    gemv = rows.shape[0] <= (GEMV_MAX_M if fast else ACT_ORDER_GEMV_MAX_M)
    if not gemv and scratch is not None:
        weight = module.dequantize_into(qweight, scales, zeros, group_size, g_idx, rows.shape[1],
                                        scratch[: n * rows.shape[1]].view(n, rows.shape[1]))  # fmt: skip
        if dest is None:
            dest = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
        if bias is None:
            result = torch.mm(rows, weight.t(), out=dest)
        else:
            result = torch.addmm(bias, rows, weight.t(), out=dest)
    else:
        result = module.int4_linear(rows, qweight, scales, zeros, group_size, g_idx, bias, dest,
                                    gemv=gemv)  # fmt: skip
    if out is not None and result.data_ptr() != out.data_ptr():
        out.view_as(result).copy_(result)
        return out
    return result.reshape(*x.shape[:-1], n) if out is None else out
