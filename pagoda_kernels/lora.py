"""Batched LoRA: every row of a step adds its own adapter's low-rank update to a projection.

A projection ``y = x @ W^T`` of a step whose rows use different adapters (or none) gets,
for each row ``t`` whose adapter sits in slot ``s = slots[t] >= 0``,

    y[t] += (x[t] @ A[s]^T) @ B[s]^T

in two ops, as punica's SGMV/BGMV do: ``lora_shrink`` (hidden -> rank: ``[T, K]``, in
float32) and ``lora_expand`` (rank -> output, added into ``y`` in place). ``A`` is
``[num_slots, K, H]`` and ``B`` ``[num_slots, N, K]``: every slot's tensors are preallocated
at the largest rank, so the ops read fixed buffers and a CUDA graph replays them with new
slot indices. The adapter's scale (``lora_alpha / r``) is folded into ``B`` when it is
loaded. A fused projection (qkv, gate/up) stacks its parts' ``A`` along ``K`` and places
each part's ``B`` in its own rows and rank columns (zero elsewhere), so one shrink and one
expand serve all of its parts.

Rows with ``slots[t] < 0`` (the base model) are left alone; their shrink rows are
undefined (the expand never reads them). The reference gathers the rows of each slot in
use; the Triton kernels (``pagoda_kernels/_triton/lora.py``) need no host-side grouping.
"""

import torch

from pagoda_kernels._backend import kernel_for


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, H], a [L, K, H], slots [T] -> [T, K] float32 (zero for base rows)."""
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot in slots.unique().tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        out[rows] = x[rows].float() @ a[slot].float().T
    return out


def lora_expand_ref(
    shrunk: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """y [T, N] += shrunk [T, K] @ b[slots]^T ([L, N, K]) for rows with a slot; returns y."""
    for slot in slots.unique().tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        y[rows] = (y[rows].float() + shrunk[rows].float() @ b[slot].float().T).to(y.dtype)
    return y


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    triton_ops = kernel_for("lora", x)
    if triton_ops is not None:
        return triton_ops.lora_shrink(x, a, slots)
    return lora_shrink_ref(x, a, slots)


def lora_expand(
    shrunk: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    triton_ops = kernel_for("lora", y)
    if triton_ops is not None:
        return triton_ops.lora_expand(shrunk, b, slots, y)
    return lora_expand_ref(shrunk, b, slots, y)


def add_lora(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """``y += (x @ a[slot]^T) @ b[slot]^T`` row by row; returns y."""
    return lora_expand(lora_shrink(x, a, slots), b, slots, y)


def add_lora_ref(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    return lora_expand_ref(lora_shrink_ref(x, a, slots), b, slots, y)
