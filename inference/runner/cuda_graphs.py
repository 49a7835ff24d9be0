"""CUDA graphs for steps (``StepGraphs``) and the padded layouts they replay.

Launching a step's kernels from Python costs more than the GPU time of a decode step or a
small prefill, so steps up to a size replay one recorded graph instead: decode steps by
bucketed batch size, mixed steps by bucketed token count. A graph reads fixed buffers, so
each step is padded to its bucket in a way that leaves the real rows' results unchanged
(``pad_step_inputs``, pure numpy and tested on CPU) and staged through pinned host
buffers with one copy per group. It lives apart from the runner because none of it is
about the model: it is handed the runner's ``forward``, the step sizes and the device,
not the runner itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from inference.layers.attention_metadata import AttentionMetadata
from inference.runner.step_inputs import StepInputs

# The model over one step's tokens: (input ids, positions, attention metadata) -> hidden.
StepForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


# Token counts at which mixed steps (prefills, chunked prefills, prefills with decodes)
# replay a graph. Launching a step's ~15 kernels per layer from Python costs 10-15 ms on
# a 28-layer model, many times the GPU time of a 512-token prefill; past 2048 tokens the
# GPU time dominates and the step runs eagerly.
MIXED_GRAPH_TOKENS = (
    16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 576, 640, 768, 896, 1024, 1280, 1536,
    1792, 2048,
)  # fmt: skip
DECODE_GRAPH_BATCHES = (
    1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640,
    768, 896, 1024,
)  # fmt: skip


def _bucket(sizes: list[int], n: int) -> int:
    return next(size for size in sizes if size >= n)


def pad_step_inputs(
    inputs: StepInputs, size: int, rows: int, tokens: np.ndarray, seqs: np.ndarray
) -> None:
    """Lay a step out for a graph of ``size`` tokens and ``rows`` sequences: ``tokens``
    [3, >= size] gets input ids, positions and slots; ``seqs`` [2, >= rows + 1] gets
    sequence lengths and query start offsets. Padding tokens write nowhere (slot -1).
    Decode steps (``rows == size``): each padding row is a sequence of one token. Mixed
    steps: the padding tokens form one sequence after the real ones, and the remaining rows
    are empty (no query tokens). Either way the real rows' results do not change."""
    n, b = len(inputs.input_ids), inputs.num_seqs
    tokens[0, :n] = inputs.input_ids
    tokens[1, :n] = inputs.positions
    tokens[2, :n] = inputs.slot_mapping
    tokens[0, n:size], tokens[1, n:size], tokens[2, n:size] = 0, 0, -1
    seqs[0, :b] = inputs.seq_lens
    seqs[1, : b + 1] = inputs.query_start_loc
    if inputs.max_query_len == 1:
        seqs[0, b:rows] = 1
        seqs[1, b + 1 : rows + 1] = np.arange(n + 1, size + 1)
    else:
        seqs[0, b] = size - n
        seqs[0, b + 1 : rows] = 0
        seqs[1, b + 1 : rows + 1] = size


class StepGraphs:
    """CUDA graphs for steps, so that a step replays one recorded graph instead of
    launching every kernel from Python:

    - decode steps (one new token per sequence), one graph per bucketed batch size; padded
      rows write nowhere (slot -1) and attend to one token;
    - mixed steps (any step with a longer query), one graph per bucketed token count, each
      with room for every sequence the scheduler may batch. The padding tokens form one
      extra sequence that writes nowhere; the rows after it are empty (no query tokens),
      so their attention programs exit at once.

    Inputs live in static buffers that each step overwrites in place; outputs of padding
    rows are ignored."""

    def __init__(
        self,
        forward: StepForward,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        """``forward``: the model over a step (recorded into the graphs); the limits are
        the scheduler's (``max_num_seqs``, ``max_num_batched_tokens``) and the block-table
        width of the longest sequence."""
        self.device = device
        max_bs = max_num_seqs
        self.batch_sizes = sorted({b for b in DECODE_GRAPH_BATCHES if b <= max_bs} | {max_bs})
        self.token_sizes = [t for t in MIXED_GRAPH_TOKENS if t <= max_num_batched_tokens]
        self.max_seqs = max_bs + 1  # rows of a mixed step: the sequences, then the padding
        max_tokens = max([max_bs, *self.token_sizes])
        max_blocks = max_blocks_per_seq
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(self.max_seqs, dtype=torch.int32, device=device)
        self.decode_query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.mixed_query_start_loc = torch.zeros(self.max_seqs + 1, dtype=torch.int32,
                                                 device=device)  # fmt: skip
        self.block_tables = torch.zeros((self.max_seqs, max_blocks), dtype=torch.int32,
                                        device=device)  # fmt: skip
        # Pinned staging, two sets used in turn: with async scheduling the host fills one
        # while the previous step's copies from the other may still be queued.
        self.host_tokens = [
            torch.zeros((3, max_tokens), dtype=torch.int64).pin_memory() for _ in range(2)
        ]
        self.host_seqs = [
            torch.zeros((2, self.max_seqs + 1), dtype=torch.int64).pin_memory() for _ in range(2)
        ]
        self.host_tables = [
            torch.zeros(self.max_seqs * max_blocks, dtype=torch.int32).pin_memory()
            for _ in range(2)
        ]
        # When each set's copies to the device have run. A set is reused two steps later,
        # but the host may be further ahead than that: a step that samples nothing (a
        # prompt chunk) is never waited for, so several can be queued behind a slow one.
        # Overwriting a set whose copies are still queued hands an earlier step a later
        # step's inputs, so the host waits for the set's event first.
        self.staged = [torch.cuda.Event() for _ in range(2)]
        self.num_runs = 0
        self.graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        # Largest first: the first capture sizes the pool that every later one shares.
        shapes = [("mixed", t) for t in reversed(self.token_sizes)]
        shapes += [("decode", b) for b in reversed(self.batch_sizes)]
        self.eager_seconds = self.record_seconds = 0.0
        with torch.inference_mode():
            for kind, size in shapes:
                args = self._capture_inputs(kind, size)
                t0 = time.perf_counter()
                forward(*args)  # compile/warm every kernel outside the capture
                torch.cuda.synchronize(device)
                t1 = time.perf_counter()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = forward(*args)
                self.graphs[kind, size] = (graph, out)
                self.eager_seconds += t1 - t0
                self.record_seconds += time.perf_counter() - t1
        torch.cuda.synchronize(device)

    def _capture_inputs(self, kind: str, size: int):
        if kind == "decode":
            self.seq_lens[:size].fill_(1)
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping[:size],
                block_tables=self.block_tables[:size],
                seq_lens=self.seq_lens[:size],
                query_start_loc=self.decode_query_start_loc[: size + 1],
                max_query_len=1,
            )
        else:
            # Recorded with all tokens in the first row; replays bring their own layout.
            self.mixed_query_start_loc.fill_(size)
            self.mixed_query_start_loc[0] = 0
            self.seq_lens.zero_()
            self.seq_lens[0] = size
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping[:size],
                block_tables=self.block_tables,
                seq_lens=self.seq_lens,
                query_start_loc=self.mixed_query_start_loc,
                max_query_len=size,
            )
        return self.input_ids[:size], self.positions[:size], meta

    def fits(self, inputs: StepInputs) -> bool:
        if inputs.max_query_len == 1:
            return inputs.num_seqs <= self.batch_sizes[-1]
        return bool(self.token_sizes) and len(inputs.input_ids) <= self.token_sizes[-1]

    def run(self, inputs: StepInputs) -> torch.Tensor:
        n = len(inputs.input_ids)
        b = inputs.num_seqs
        decode = inputs.max_query_len == 1
        size = _bucket(self.batch_sizes if decode else self.token_sizes, n)
        # Staged in pinned host buffers, one copy per group; padding gets harmless values.
        # Two sets used in turn, each reused once its last copies have run.
        which = self.num_runs % 2
        self.num_runs += 1
        device = self.device
        self.staged[which].synchronize()  # at once unless the GPU is two steps behind
        host_tokens, host_seqs = self.host_tokens[which], self.host_seqs[which]
        rows = size if decode else self.max_seqs
        pad_step_inputs(inputs, size, rows, host_tokens.numpy(), host_seqs.numpy())
        staged = host_tokens[:, :size].to(device, non_blocking=True)
        self.input_ids[:size].copy_(staged[0])
        self.positions[:size].copy_(staged[1])
        self.slot_mapping[:size].copy_(staged[2])
        if decode:  # the decode graphs' query_start_loc never changes
            self.seq_lens[:size].copy_(host_seqs[0, :size].to(device, non_blocking=True))
        else:
            staged = host_seqs[:, : rows + 1].to(device, non_blocking=True)
            self.seq_lens.copy_(staged[0, :rows])
            self.mixed_query_start_loc.copy_(staged[1])
        width = inputs.block_tables.shape[1]
        host_tables = self.host_tables[which]
        host_tables.numpy()[: b * width].reshape(b, width)[:] = inputs.block_tables
        self.block_tables[:b, :width].copy_(
            host_tables[: b * width].view(b, width).to(device, non_blocking=True)
        )
        self.staged[which].record()
        graph, out = self.graphs["decode" if decode else "mixed", size]
        graph.replay()
        return out[:n]
