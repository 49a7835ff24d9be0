"""GPTQ's layout (AutoGPTQ / GPTQModel), decoded to the codes, scales and zero points of
``int4.py``.

Per projection [N, K]: ``qweight`` int32 [K / 8, N], packed along K (nibble i of row r is
input 8 r + i); ``qzeros`` int32 [G, N / 8], packed along N in order; ``scales`` [G, N];
``g_idx`` int32 [K] (the group of every input; a permutation of ``k // G`` under
``desc_act``). The v1 format (``checkpoint_format: "gptq"``, AutoGPTQ's) stores every zero
point minus one: zero = stored + 1 (symmetric: 7 stored for 8); ``gptq_v2`` stores it as is.
"""

from __future__ import annotations

import torch

from inference.quantization.int4_config import Int4Checkpoint
from inference.quantization.int4_packing import PACK, read_packed, unpack_words

PACKED_NAME = "qweight"
AUX_NAMES = ("qzeros", "scales", "g_idx")


def logical_shape(packed_shape: tuple[int, ...], aux: dict) -> tuple[int, int]:
    return packed_shape[1], packed_shape[0] * PACK


def read_codes(packed, source: tuple[int | None, int, int]) -> torch.Tensor:
    dim, start, length = source
    if dim == 1:  # input features: packed eight a word
        words = read_packed(packed, 0, start, length, "input features")
    else:
        words = read_packed(packed, 1 if dim == 0 else None, start, length)
    codes = unpack_words(words.T.contiguous())  # [n, K / 8, 8]
    return codes.reshape(words.shape[1], -1)


def metadata(aux: dict, scheme: Int4Checkpoint, n: int, k: int):
    scales = aux["scales"].float().T
    zeros = unpack_words(aux["qzeros"]).reshape(aux["qzeros"].shape[0], -1)[:, :n].T
    zeros = zeros + scheme.zero_offset
    g_idx = aux.get("g_idx")
    return scales, zeros, None if g_idx is None else g_idx.to(torch.int32)
