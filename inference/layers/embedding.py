"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the
vocabulary's rows (padded so every slice has one shape)."""

from __future__ import annotations

import torch
from torch import nn

from inference.parallel_state import ParallelContext


def vocab_parallel_embedding(
    input_ids: torch.Tensor, weight: torch.Tensor, vocab_start: int, parallel: ParallelContext
) -> torch.Tensor:
    """Rows for the ids inside this rank's slice, zeros elsewhere, summed over ranks."""
    local = input_ids - vocab_start
    outside = (local < 0) | (local >= weight.shape[0])
    hidden = nn.functional.embedding(local.masked_fill(outside, 0), weight)
    hidden = hidden.masked_fill(outside.unsqueeze(-1), 0)
    return parallel.all_reduce(hidden)


def vocab_parallel_logits(
    hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, parallel: ParallelContext
) -> torch.Tensor:
    """Full-vocabulary logits on every rank: local logits, all-gathered, padding cut off."""
    logits = parallel.all_gather_last_dim(nn.functional.linear(hidden, weight))
    return logits[..., :vocab_size]
