"""Rotary position embedding (GPT-NeoX "rotate half" layout, as Llama/Qwen/Mistral use)."""

import torch

from pagoda_kernels._backend import kernel_for


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] by the angles of ``positions`` [T].

    cos_sin_cache: [max_position, D] float32, cos in the first D/2 columns, sin in the rest.
    Returns new tensors of q's and k's dtype.
    """
    half = cos_sin_cache.shape[-1] // 2
    cos_sin = cos_sin_cache[positions.long()]
    cos = cos_sin[:, None, :half].to(q.dtype)
    sin = cos_sin[:, None, half:].to(q.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(q), rotate(k)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as the reference. The Triton path rotates q and k in place and returns
    them; use the returned pair."""
    triton_ops = kernel_for("rotary", q)
    if triton_ops is not None:
        return triton_ops.rotary_embedding(positions, q, k, cos_sin_cache)
    return rotary_embedding_ref(positions, q, k, cos_sin_cache)
