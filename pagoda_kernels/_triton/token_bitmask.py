"""Triton grammar mask: -inf stored wherever a row's packed bitmask has a 0 bit, in place."""

import torch
import triton
import triton.language as tl

from pagoda_kernels._triton.pdl import launch_pdl, wait_for_inputs


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr, bitmask_ptr, rows_ptr, stride_logits, stride_bitmask, vocab, num_words,
    HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    wait_for_inputs()
    index = tl.program_id(0).to(tl.int64)
    if HAS_ROWS:
        row = tl.load(rows_ptr + index).to(tl.int64)
    else:
        row = index
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    word_ids = tokens // 32
    # Tokens past the bitmask's words read 0: forbidden.
    words = tl.load(bitmask_ptr + index * stride_bitmask + word_ids,
                    mask=word_ids < num_words, other=0)  # fmt: skip
    forbidden = ((words >> (tokens % 32)) & 1) == 0
    minus_inf = tl.full((BLOCK,), float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + tokens, minus_inf,
             mask=(tokens < vocab) & forbidden)  # fmt: skip


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    num_rows, num_words = bitmask.shape
    vocab = logits.shape[1]
    if num_rows and vocab:
        assert logits.stride(1) == 1 and bitmask.stride(1) == 1
        block = min(4096, triton.next_power_of_2(vocab))
        _apply_token_bitmask_kernel[(num_rows, triton.cdiv(vocab, block))](
            logits, bitmask, rows if rows is not None else bitmask,
            logits.stride(0), bitmask.stride(0), vocab, num_words,
            HAS_ROWS=rows is not None, BLOCK=block, num_warps=4,
            launch_pdl=launch_pdl(logits),
        )  # fmt: skip
    return logits
