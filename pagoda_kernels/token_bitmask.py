"""Structured outputs' grammar mask applied to logits in place: every token whose bit is 0
in its row's packed bitmask becomes -inf.

The bitmask is what llguidance fills on the host: int32 words, bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed. Only the packed words cross to the device
(32 times less than a boolean mask). The Triton kernel reads each word once per token
block and stores -inf where a bit is clear, reading no logits and allocating nothing;
the reference unpacks bytes (NumPy's ``unpackbits`` on the host, eight shifts of the
uint8 view elsewhere), never the [rows, words, 32] int32 expansion.
"""

import numpy as np
import torch

from pagoda_kernels._backend import kernel_for


def unpack_bytes(bitmask: torch.Tensor) -> torch.Tensor:
    """[R, W] int32 words -> [R, 32 W] booleans with torch ops on the words' device: eight
    shifts of the little-endian uint8 view (bit order within a byte is token order)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    return ((bitmask.view(torch.uint8).unsqueeze(-1) >> shifts) & 1).bool().flatten(1)


def unpack_allowed(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """[R, W] int32 words -> [R, width] booleans (True: allowed); columns past 32 W are
    False (a bitmask narrower than the logits forbids the tokens it does not cover)."""
    if bitmask.device.type == "cpu":
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(bits).view(torch.bool)
    else:
        allowed = unpack_bytes(bitmask)
    if allowed.shape[1] < width:
        allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]))
    return allowed[:, :width]


def apply_token_bitmask_ref(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """In place: ``logits[rows[i], t] = -inf`` wherever bit t of ``bitmask[i]`` is 0 (rows
    None: row i). ``logits`` [B, V] float; ``bitmask`` [R, W] int32 and ``rows`` [R] int64
    on the logits' device. Other rows are untouched. Returns ``logits``."""
    forbidden = unpack_allowed(bitmask, logits.shape[1]).logical_not_()
    if rows is None:
        return logits.masked_fill_(forbidden, float("-inf"))
    logits[rows] = logits[rows].masked_fill_(forbidden, float("-inf"))
    return logits


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    triton_ops = kernel_for("token_bitmask", logits)
    if triton_ops is not None:
        return triton_ops.apply_token_bitmask(logits, bitmask, rows)
    return apply_token_bitmask_ref(logits, bitmask, rows)
