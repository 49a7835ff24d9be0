"""A step's inputs as host arrays, and how the device fills in what the host has not seen.

``StepInputs`` is the one form a step travels in: the runner copies it to the device, the
CUDA graphs stage it into their static buffers, and the tensor-parallel executor pickles it
once for every worker. It is plain numpy so that building it costs Python one pass over
the sequences and never a loop over tokens (``build_step_inputs``), and so that the engine
process, which holds no GPU under tensor parallelism, can build it too.

With async scheduling a step is built before the previous step's samples reach the host:
those tokens appear as placeholders (negative ids) that ``resolve_placeholders`` replaces
on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from inference.lora.request import LoRARequest
from inference.lora.slots import LoRASlotTable
from inference.sequence import Sequence


@dataclass
class StepInputs:
    """A step's inputs as host arrays: one row per sequence, one entry per new token."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    seq_lens: np.ndarray  # [B] int32
    query_start_loc: np.ndarray  # [B + 1] int64
    block_tables: np.ndarray  # [B, max_blocks] int32
    max_query_len: int
    # LoRA (``inference.lora``): each token's adapter slot (-1: the base model; None: no
    # adapter in the step), and the (slot, adapter) loads to do before it runs.
    lora_slots: np.ndarray | None = None  # [T] int32
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def has_placeholders(self) -> bool:
        return bool(len(self.input_ids)) and int(self.input_ids.min()) < 0


def build_step_inputs(
    seqs: list[Sequence], num_new_tokens: list[int], block_size: int,
    lora_table: LoRASlotTable | None = None,
) -> StepInputs:
    """Vectorised over tokens: Python touches each sequence once, never each token.
    ``lora_table``: the engine serves LoRA adapters; it places this step's in slots."""
    counts = np.asarray(num_new_tokens, dtype=np.int64)
    starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, len(seqs))
    query_start_loc = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start_loc[1:])
    total = int(query_start_loc[-1])
    row_of_token = np.repeat(np.arange(len(seqs)), counts)
    positions = np.arange(total) - query_start_loc[row_of_token] + starts[row_of_token]
    # A speculating row's query ends with its drafts (speculative decoding: the scheduler
    # trimmed them to the row's share of the budget).
    input_ids = np.fromiter(
        (t for s, c, n in zip(seqs, starts, counts)
         for t in chain(s.token_ids[c : c + n], s.draft_token_ids)),
        np.int64,
        total,
    )
    block_tables = np.zeros((len(seqs), max(len(s.block_table) for s in seqs)), np.int32)
    for row, seq in enumerate(seqs):
        block_tables[row, : len(seq.block_table)] = seq.block_table
    slot_mapping = (
        block_tables[row_of_token, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )
    lora_slots, lora_loads = None, []
    if lora_table is not None and any(s.lora_request is not None for s in seqs):
        row_slots, lora_loads = lora_table.assign([s.lora_request for s in seqs])
        lora_slots = np.repeat(np.asarray(row_slots, dtype=np.int32), counts)
    return StepInputs(
        lora_slots=lora_slots,
        lora_loads=lora_loads,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        seq_lens=(starts + counts).astype(np.int32),
        query_start_loc=query_start_loc,
        block_tables=block_tables,
        max_query_len=int(counts.max()),
    )


def resolve_placeholders(input_ids: torch.Tensor, sampled_ids: torch.Tensor) -> torch.Tensor:
    """Replace each id ``-1 - i`` by ``sampled_ids[i]``; other ids pass through."""
    return torch.where(input_ids < 0, sampled_ids[(-1 - input_ids).clamp_(min=0)], input_ids)

