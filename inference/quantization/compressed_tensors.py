"""compressed-tensors ``pack-quantized`` int4 weights, decoded to the codes, scales and
zero points of ``int4.py``.

Per projection [N, K] (``weight_shape``): ``weight_packed`` int32 [N, ceil(K / 8)], packed
along K in order (nibble i of word c is input 8 c + i), each signed value v in -8..7
stored as v + 8; ``weight_scale`` [N, G] (``strategy: channel``: [N, 1]); asymmetric
schemes add ``weight_zero_point`` int32 [ceil(N / 8), G], packed along N the same way
(signed, + 8), and ``actorder: group`` adds ``weight_g_idx`` [K]. ``weight = (v - zero) *
scale``, which in stored codes is ``(q - (zero + 8)) * scale``: symmetric zero 8.
"""

from __future__ import annotations

import torch

from inference.quantization.int4_config import Int4Checkpoint
from inference.quantization.int4_packing import read_packed, unpack_words

PACKED_NAME = "weight_packed"
AUX_NAMES = ("weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")


def logical_shape(packed_shape: tuple[int, ...], aux: dict) -> tuple[int, int]:
    if "weight_shape" not in aux:
        raise ValueError("a compressed-tensors pack-quantized weight without weight_shape")
    n, k = (int(v) for v in aux["weight_shape"].tolist())
    return n, k


def read_codes(packed, source: tuple[int | None, int, int]) -> torch.Tensor:
    dim, start, length = source
    if dim == 1:
        words = read_packed(packed, 1, start, length, "input features")
        return unpack_words(words).reshape(words.shape[0], -1)[:, :length]
    words = read_packed(packed, 0 if dim == 0 else None, start, length)
    return unpack_words(words).reshape(words.shape[0], -1)


def metadata(aux: dict, scheme: Int4Checkpoint, n: int, k: int):
    scales = aux["weight_scale"].float()
    if "weight_zero_point" in aux:
        packed = aux["weight_zero_point"]
        if packed.dtype != torch.int32:  # an older release's unpacked signed zero points
            zeros = packed.to(torch.int32) + 8
        else:
            zeros = unpack_words(packed.T.contiguous()).reshape(packed.shape[1], -1)[:, :n].T
    else:
        zeros = torch.full(scales.shape, 8, dtype=torch.int32)
    g_idx = aux.get("weight_g_idx")
    return scales, zeros, None if g_idx is None else g_idx.to(torch.int32)
