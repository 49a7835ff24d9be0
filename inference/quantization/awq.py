"""AutoAWQ's GEMM layout, decoded to the codes, scales and zero points of ``int4.py``.

Per projection [N, K]: ``qweight`` int32 [K, N / 8] and ``qzeros`` int32 [K / G, N / 8],
both packed along N with AWQ's interleaved order: the eight nibbles of a word, from the
lowest, hold columns 0, 2, 4, 6, 1, 3, 5, 7 of its eight; ``scales`` [K / G, N] (fp16).
Zero points are stored as they are (no offset); ``weight = (q - zero) * scale``.
"""

from __future__ import annotations

import torch

from inference.quantization.int4_config import Int4Checkpoint
from inference.quantization.int4_packing import PACK, read_packed, unpack_words

PACKED_NAME = "qweight"
AUX_NAMES = ("qzeros", "scales")
# Nibble i of a word holds column ORDER[i] of the word's eight.
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _columns(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] packed along columns -> codes [R, 8 C] in column order."""
    nibbles = unpack_words(words)  # [R, C, 8], nibble order
    inverse = [ORDER.index(c) for c in range(PACK)]
    return nibbles[:, :, inverse].reshape(words.shape[0], -1)


def logical_shape(packed_shape: tuple[int, ...], aux: dict) -> tuple[int, int]:
    return packed_shape[1] * PACK, packed_shape[0]


def read_codes(packed, source: tuple[int | None, int, int]) -> torch.Tensor:
    """Codes [n, k] of the part ``source`` (dim of [N, K], start, length)."""
    dim, start, length = source
    if dim == 0:  # output columns: packed eight a word
        words = read_packed(packed, 1, start, length, "output features")
    else:
        words = read_packed(packed, 0 if dim == 1 else None, start, length)
    return _columns(words).T


def metadata(aux: dict, scheme: Int4Checkpoint, n: int, k: int):
    """(scales float32 [N, G], zeros [N, G], g_idx None) of the whole projection."""
    scales = aux["scales"].float().T
    if "qzeros" in aux:
        zeros = _columns(aux["qzeros"]).T[:n]
    else:  # zero_point false: symmetric codes around 8
        zeros = torch.full_like(scales, 8, dtype=torch.int32)
    return scales, zeros, None
