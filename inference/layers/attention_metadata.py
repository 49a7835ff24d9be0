"""What every attention layer needs to know about the step: one small dataclass, passed
explicitly from the model runner through the model to each layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda_kernels.attention import LongPrefill


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (-1: padding)
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32: context length including this step's tokens
    query_start_loc: torch.Tensor  # [B + 1] int32: where each sequence's rows start
    max_query_len: int  # host-side hint: 1 means a pure decode step
    # Host-side: sequences whose attention runs through SDPA (eager steps only).
    long_prefills: tuple[LongPrefill, ...] = ()
