"""CUDA graphs for steps (``StepGraphs``) and the padded layouts they replay.

Launching a step's kernels from Python costs more than the GPU time of a decode step or a
small prefill, so steps up to a size replay one recorded graph instead: decode steps by
bucketed batch size, mixed steps by bucketed token count. A graph reads fixed buffers, so
each step is padded to its bucket in a way that leaves the real rows' results unchanged
(``pad_step_inputs``, pure numpy and tested on CPU) and staged through pinned host
buffers with one copy per group. It lives apart from the runner because none of it is
about the model: it is handed the runner's ``forward``, the step sizes and the device,
not the runner itself.

Limits raised in a running engine (``inference.reconfigure``) need graphs for sizes past
the captured ones: ``GraphExtension`` records only those, on a thread of its own, while the
engine keeps replaying the graphs it has; see there for what each thread touches.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from inference.layers.attention_metadata import AttentionMetadata
from inference.runner.step_inputs import StepInputs

# The model over one step's tokens: (input ids, positions, attention metadata) -> hidden.
StepForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
# What decode graphs record after the forward, on its output (a draft model's greedy pick).
DecodeHead = Callable[[torch.Tensor], torch.Tensor]


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


def graph_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> tuple[list[int], list[int]]:
    """The decode batches and mixed-step token counts that get a graph under these limits."""
    batches = sorted({b for b in DECODE_GRAPH_BATCHES if b <= max_num_seqs} | {max_num_seqs})
    return batches, [t for t in MIXED_GRAPH_TOKENS if t <= max_num_batched_tokens]


def mixed_rows(max_num_seqs: int) -> int:
    """Rows of a mixed step's graph: room for every sequence, then the padding one."""
    return max_num_seqs + 1


def missing_shapes(
    have: dict[tuple[str, int], int], max_num_seqs: int, max_num_batched_tokens: int
) -> list[tuple[str, int]]:
    """The (kind, size) graphs that steps under these limits need and ``have`` (shape ->
    the rows its graph holds) lacks, largest first: a decode batch not captured, a token
    count not captured, or a mixed graph with too few rows for the sequences a step of its
    size may now hold (a step of n tokens holds at most n sequences)."""
    batches, tokens = graph_sizes(max_num_seqs, max_num_batched_tokens)
    mixed = [("mixed", t) for t in reversed(tokens)
             if have.get(("mixed", t), 0) < mixed_rows(min(t, max_num_seqs))]  # fmt: skip
    return mixed + [("decode", b) for b in reversed(batches) if ("decode", b) not in have]


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


class _StaticBuffers:
    """The fixed device inputs a set of graphs reads, for steps of up to ``max_num_seqs``
    sequences and ``max_tokens`` tokens, and the pinned host buffers that stage them."""

    def __init__(self, max_num_seqs: int, max_tokens: int, max_blocks: int,
                 device: torch.device) -> None:  # fmt: skip
        self.max_seqs = mixed_rows(max_num_seqs)  # rows of a mixed step
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(self.max_seqs, dtype=torch.int32, device=device)
        self.decode_query_start_loc = torch.arange(max_num_seqs + 1, dtype=torch.int32,
                                                   device=device)  # fmt: skip
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

    def rows(self, kind: str, size: int) -> int:
        return size if kind == "decode" else self.max_seqs

    def capture_inputs(self, kind: str, size: int):
        """The forward's arguments for recording a graph of ``kind`` and ``size`` (writes
        these buffers, on the current stream)."""
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


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    out: torch.Tensor  # the graph's output, written by each replay
    buffers: _StaticBuffers  # the inputs it reads
    rows: int  # sequences + 1 it holds (mixed), or its batch (decode)


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
    rows are ignored. Graphs recorded later for raised limits (``GraphExtension``) bring
    buffers of their own; each graph is staged through the buffers it reads. With a
    ``decode_head`` the decode graphs end in it: their replays return its output.

    A replay's output is the graph's own tensor, overwritten by the next replay of that
    graph: read it (or copy it) before then, in stream order."""

    def __init__(
        self,
        forward: StepForward,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_blocks_per_seq: int,
        device: torch.device,
        decode_head: DecodeHead | None = None,
    ) -> None:
        """Captures every graph the limits need. ``forward``: the model over a step
        (recorded into the graphs); the limits are the scheduler's (``max_num_seqs``,
        ``max_num_batched_tokens``) and the block-table width of the longest sequence;
        ``decode_head``: recorded after the forward in decode graphs only."""
        self.forward = forward
        self.decode_head = decode_head
        self.device = device
        self.max_blocks = max_blocks_per_seq
        self.graphs: dict[tuple[str, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        # Token counts whose kernels have run eagerly: a later graph of one of these sizes
        # needs no warm-up run (``GraphExtension``).
        self.warmed_tokens: set[int] = set()
        batch_sizes, token_sizes = graph_sizes(max_num_seqs, max_num_batched_tokens)
        buffers = _StaticBuffers(max_num_seqs, max([max_num_seqs, *token_sizes]),
                                 max_blocks_per_seq, device)  # fmt: skip
        # Largest first: the first capture sizes the pool that every later one shares.
        shapes = [("mixed", t) for t in reversed(token_sizes)]
        shapes += [("decode", b) for b in reversed(batch_sizes)]
        self.eager_seconds = self.record_seconds = 0.0
        with torch.inference_mode():
            for kind, size in shapes:
                args = buffers.capture_inputs(kind, size)
                t0 = time.perf_counter()
                self.graph_forward(kind, args)  # compile/warm every kernel outside the capture
                torch.cuda.synchronize(device)
                self.warmed_tokens.add(size)
                t1 = time.perf_counter()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self.graph_forward(kind, args)
                self.graphs[kind, size] = _Graph(graph, out, buffers, buffers.rows(kind, size))
                self.eager_seconds += t1 - t0
                self.record_seconds += time.perf_counter() - t1
        torch.cuda.synchronize(device)
        self._index()

    def graph_forward(self, kind: str, args: tuple) -> torch.Tensor:
        """What a graph of ``kind`` records: the forward, then (decode) the decode head."""
        out = self.forward(*args)
        return out if kind != "decode" or self.decode_head is None else self.decode_head(out)

    def _index(self) -> None:
        self.batch_sizes = sorted(size for kind, size in self.graphs if kind == "decode")
        self.token_sizes = sorted(size for kind, size in self.graphs if kind == "mixed")

    def shapes(self) -> dict[tuple[str, int], int]:
        """Every graph's (kind, size) and the rows it holds."""
        return {shape: entry.rows for shape, entry in self.graphs.items()}

    def merged(self, recorded: dict[tuple[str, int], _Graph]) -> StepGraphs:
        """These graphs with ``recorded`` added (replacing those of the same shape)."""
        merged = object.__new__(StepGraphs)
        merged.__dict__.update(self.__dict__)
        merged.graphs = {**self.graphs, **recorded}
        merged.warmed_tokens = self.warmed_tokens | {size for _, size in recorded}
        merged._index()
        return merged

    def fits(self, inputs: StepInputs) -> bool:
        if inputs.max_query_len == 1:
            return inputs.num_seqs <= self.batch_sizes[-1]
        n = len(inputs.input_ids)
        if not self.token_sizes or n > self.token_sizes[-1]:
            return False
        return inputs.num_seqs < self.graphs["mixed", _bucket(self.token_sizes, n)].rows

    def run(self, inputs: StepInputs) -> torch.Tensor:
        n = len(inputs.input_ids)
        b = inputs.num_seqs
        decode = inputs.max_query_len == 1
        size = _bucket(self.batch_sizes if decode else self.token_sizes, n)
        entry = self.graphs["decode" if decode else "mixed", size]
        buffers = entry.buffers
        # Staged in pinned host buffers, one copy per group; padding gets harmless values.
        # Two sets used in turn, each reused once its last copies have run.
        which = buffers.num_runs % 2
        buffers.num_runs += 1
        device = self.device
        buffers.staged[which].synchronize()  # at once unless the GPU is two steps behind
        host_tokens, host_seqs = buffers.host_tokens[which], buffers.host_seqs[which]
        rows = entry.rows
        pad_step_inputs(inputs, size, rows, host_tokens.numpy(), host_seqs.numpy())
        staged = host_tokens[:, :size].to(device, non_blocking=True)
        buffers.input_ids[:size].copy_(staged[0])
        buffers.positions[:size].copy_(staged[1])
        buffers.slot_mapping[:size].copy_(staged[2])
        if decode:  # the decode graphs' query_start_loc never changes
            buffers.seq_lens[:size].copy_(host_seqs[0, :size].to(device, non_blocking=True))
        else:
            staged = host_seqs[:, : rows + 1].to(device, non_blocking=True)
            buffers.seq_lens.copy_(staged[0, :rows])
            buffers.mixed_query_start_loc.copy_(staged[1])
        width = inputs.block_tables.shape[1]
        host_tables = buffers.host_tables[which]
        host_tables.numpy()[: b * width].reshape(b, width)[:] = inputs.block_tables
        buffers.block_tables[:b, :width].copy_(
            host_tables[: b * width].view(b, width).to(device, non_blocking=True)
        )
        buffers.staged[which].record()
        entry.graph.replay()
        return entry.out[:n]


class CaptureCancelled(RuntimeError):
    """The engine stopped while graphs were being recorded."""


class GraphExtension:
    """The graphs that raised limits need and ``graphs`` lacks (``missing_shapes``),
    recorded while the engine keeps stepping on the graphs it has; ``merged`` is then what
    to switch to, between two steps. The graphs already captured stay valid: they read
    their own buffers, the KV cache and the sampled-ids buffer, none of which this moves.

    Who touches what, with the stepping thread replaying the old graphs meanwhile:

    - made on the stepping thread, between steps: new static buffers and pinned staging
      (device memory allocated and zeroed on the stepping thread's stream, so no block the
      caching allocator hands out is shared across streams), and one eager warm-up run for
      each new size whose token count never ran eagerly (``warm_up``): a warm-up executes,
      and besides its own buffers it writes what every forward writes (scratch shared by
      layers, e.g. the int4 dequantisation buffer), so it must not overlap a step;
    - ``record``, on a thread of its own with its own stream: writes only the new buffers
      (the record-time layout), then records each graph with ``capture_error_mode=
      "thread_local"`` (the stepping thread's CUDA calls neither break the capture nor are
      refused by it) into the old graphs' memory pool. Recording executes nothing: the
      kernels' reads and writes (KV cache, sampled ids, shared scratch) happen only when a
      graph is replayed, on the stepping thread's stream, one graph at a time, as the
      graphs sharing a pool must. The capture's allocations come from that pool (only
      allocations on the capturing stream go there); the stepping thread's own
      allocations go to the ordinary pool as before. No ``torch.cuda.graph`` context here:
      it synchronizes the device, collects garbage and empties the allocator's cache
      around every graph, which would stall the steps it runs beside.
    - LoRA: the graphs record the adapter ops whatever the step (``DeviceLoRAs.capturing``
      ran at start-up); its device buffers are the stepping thread's and only read here.

    Python's GIL is shared: recording competes with the step loop for the host, so steps
    are slower (not stopped) while it runs."""

    def __init__(self, graphs: StepGraphs, max_num_seqs: int, max_num_batched_tokens: int):
        self.base = graphs
        self.shapes = missing_shapes(graphs.shapes(), max_num_seqs, max_num_batched_tokens)
        sizes = [size for _, size in self.shapes]
        self.buffers = _StaticBuffers(max_num_seqs, max([max_num_seqs, *sizes]),
                                      graphs.max_blocks, graphs.device)  # fmt: skip
        self.stream = torch.cuda.current_stream(graphs.device)  # the stepping thread's
        # The capture thread's device (set per thread): "cuda" names the current one.
        index = graphs.device.index
        self.device_index = torch.cuda.current_device() if index is None else index
        self.recorded: dict[tuple[str, int], _Graph] = {}
        self.cancelled = threading.Event()
        self.warm_up_seconds = 0.0

    @torch.inference_mode()
    def warm_up(self) -> None:
        """On the stepping thread, between steps: one eager run of each new size whose
        token count has not run (its kernels' variants compile here, not in the capture)."""
        start = time.perf_counter()
        cold = [(k, s) for k, s in self.shapes if s not in self.base.warmed_tokens]
        for kind, size in cold:
            self.base.graph_forward(kind, self.buffers.capture_inputs(kind, size))
        torch.cuda.synchronize(self.base.device)
        self.warm_up_seconds = time.perf_counter() - start

    def record(self) -> None:
        """On the capture thread: records the missing graphs. Raises CaptureCancelled once
        ``cancel`` was called (checked between graphs)."""
        device = self.base.device
        torch.cuda.set_device(self.device_index)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(self.stream)  # the buffers were zeroed on the stepping stream
        with torch.inference_mode(), torch.cuda.stream(stream):
            # This thread's cuBLAS and cuBLASLt handles and this stream's workspaces (large
            # steps' linears are cuBLAS), made outside any capture, which may not make
            # them; on private tensors.
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                scratch = torch.ones((16, 16), dtype=dtype, device=device)
                torch.addmm(scratch[0], scratch, scratch.t())
                torch.mm(scratch, scratch.t())
            for kind, size in self.shapes:
                if self.cancelled.is_set():
                    raise CaptureCancelled("the engine stopped during the graph capture")
                args = self.buffers.capture_inputs(kind, size)
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(self.base.pool, capture_error_mode="thread_local")
                try:
                    out = self.base.graph_forward(kind, args)
                except BaseException:
                    with contextlib.suppress(Exception):  # the forward's error is the one
                        graph.capture_end()
                    raise
                graph.capture_end()
                self.recorded[kind, size] = _Graph(graph, out, self.buffers,
                                                   self.buffers.rows(kind, size))  # fmt: skip
            stream.synchronize()  # the buffers' record-time writes, before any replay

    def cancel(self) -> None:
        self.cancelled.set()

    def merged(self) -> StepGraphs:
        return self.base.merged(self.recorded)
