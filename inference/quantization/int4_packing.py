"""Nibbles in int32 words, shared by the int4 format decoders and the kernels' layout."""

from __future__ import annotations

import torch

PACK = 8  # 4-bit codes per int32 word
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_words(words: torch.Tensor) -> torch.Tensor:
    """int32 [...] -> int32 [..., 8]: nibble i (bits 4 i .. 4 i + 3) at index i."""
    return (words.to(torch.int32)[..., None] >> _SHIFTS.to(words.device)) & 0xF


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (0..15) -> int32 [N, ceil(K / 8)], code k in nibble k % 8 of word k // 8
    (the layout of ``kernels.int4_linear``)."""
    n, k = codes.shape
    padded = torch.zeros(n, -(-k // PACK) * PACK, dtype=torch.int64, device=codes.device)
    padded[:, :k] = codes
    nibbles = padded.view(n, -1, PACK) << _SHIFTS.to(codes.device, torch.int64)
    words = nibbles.sum(dim=2)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def read_packed(packed, dim: int | None, start: int, length: int,
                packed_features: str | None = None) -> torch.Tensor:  # fmt: skip
    """The part of a packed tensor (or lazy safetensors entry) along ``dim`` (None: all);
    ``packed_features`` names the features when ``dim`` is the packed one, whose start and
    length are then in codes and must fall on word boundaries."""
    from inference.quantization.fp8 import read_part

    if dim is not None and packed_features is not None:
        if start % PACK or (length % PACK and start + length != _codes_along(packed, dim)):
            raise ValueError(
                f"tensor parallelism splits the 4-bit weight's {packed_features} at "
                f"{start}..{start + length}, not on the {PACK}-value words they are packed in"
            )
        start, length = start // PACK, -(-length // PACK)
    return read_part(packed, (dim, start, length))


def _codes_along(packed, dim: int) -> int:
    return tuple(packed.shape)[dim] * PACK
