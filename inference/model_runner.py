"""Turns a scheduled batch into tensors, runs the model, samples.

Owns the model weights and the KV cache tensors: one (key, value) pair per layer, each
``[num_blocks, block_size, num_kv_heads, head_dim]``; the block ids handed out by the
block manager index their first dimension.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from inference.config import ResolvedEngineConfig
from inference.distributed.parallel_state import SINGLE, ParallelContext, kv_head_range
from inference.layers.attention_metadata import AttentionMetadata
from inference.models.config import ModelConfig
from inference.models.loader import load_model
from inference.sampler import (
    SampledTokens,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    compute_prompt_logprobs,
    prompt_logprobs_to_host,
)
from inference.sequence import Sequence
from kernels._backend import kernel_for

logger = logging.getLogger(__name__)

_GIB = 1 << 30


class ModelRunner:
    def __init__(
        self,
        config: ResolvedEngineConfig,
        model_config: ModelConfig,
        model_path: str,
        device: torch.device,
        dtype: torch.dtype,
        parallel: ParallelContext = SINGLE,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        # Tensor parallelism: this rank's share of the KV heads (all of them on one GPU).
        self.parallel = parallel
        _, self.num_kv_heads = kv_head_range(
            model_config.num_kv_heads, parallel.rank, parallel.world_size
        )
        start = time.perf_counter()
        self.model = load_model(
            model_path, model_config, dtype, device, config.max_model_len, config.load_format,
            parallel,
        )
        self.load_seconds = time.perf_counter() - start
        self.sampler = Sampler()
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.graphs: StepGraphs | None = None
        # The last step's sampled ids, where the next step's placeholders read them.
        self.sampled_ids = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=device)

    # -- KV cache sizing ---------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        cfg = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * cfg.num_layers * self.block_size * self.num_kv_heads * cfg.head_dim * elem

    def determine_num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            return self._profile_gpu_blocks()
        # On CPU: a fixed budget, and no more than the configured batch could ever use.
        budget_blocks = int(self.config.cpu_kv_cache_gib * _GIB) // self.bytes_per_block
        blocks_per_seq = -(-self.config.max_model_len // self.block_size)
        return max(1, min(budget_blocks, self.config.max_num_seqs * blocks_per_seq))

    def _profile_gpu_blocks(self) -> int:
        """Run the largest step the scheduler can produce, measure the peak, and give the
        rest of ``gpu_memory_utilization`` of the card to the KV cache."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = self.config.max_num_batched_tokens
        scratch_blocks = -(-num_tokens // self.block_size) + 1
        self.allocate_kv_cache(scratch_blocks)
        scratch_bytes = scratch_blocks * self.bytes_per_block
        self.profile_run(num_tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - scratch_bytes
        self.kv_caches = []
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        # Memory held outside torch's allocator (CUDA context, NCCL, other processes).
        non_torch = total - free - torch.cuda.memory_reserved(self.device)
        budget = total * self.config.gpu_memory_utilization - peak - max(non_torch, 0)
        num_blocks = int(budget // self.bytes_per_block)
        logger.info(
            "memory profile: peak activations+weights %.2f GiB, other %.2f GiB, KV budget "
            "%.2f GiB", peak / _GIB, non_torch / _GIB, budget / _GIB,
        )
        if num_blocks < 1:
            raise ValueError(
                f"no GPU memory left for the KV cache at gpu_memory_utilization="
                f"{self.config.gpu_memory_utilization}: the model and a step of "
                f"{num_tokens} tokens need {peak / _GIB:.2f} GiB of {total / _GIB:.2f} GiB"
            )
        return num_blocks

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """One forward over ``num_tokens`` prompt tokens in a single sequence."""
        meta = self._one_sequence_metadata(num_tokens)
        ids = torch.randint(0, self.model_config.vocab_size, (num_tokens,), device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % self.config.max_model_len
        hidden = self.model(ids, positions, self.kv_caches, meta)
        self.model.compute_logits(hidden[-self.config.max_num_seqs :])

    def _one_sequence_metadata(self, num_tokens: int) -> AttentionMetadata:
        """A prompt of ``num_tokens`` in blocks 0, 1, ... (profiling and warm-up runs)."""
        max_blocks = -(-num_tokens // self.block_size)
        return AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=self.device),
            block_tables=torch.arange(max_blocks, device=self.device, dtype=torch.int32)[None],
            seq_lens=torch.tensor([num_tokens], device=self.device, dtype=torch.int32),
            query_start_loc=torch.tensor([0, num_tokens], device=self.device, dtype=torch.int32),
            max_query_len=num_tokens,
        )

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.model_config
        shape = (num_blocks, self.block_size, self.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(cfg.num_layers)
        ]
        self.num_blocks = num_blocks

    def close(self) -> None:
        """Nothing to release in-process; the tensor-parallel executor's counterpart stops
        its workers."""

    # -- one step ----------------------------------------------------------------------
    def _to_device(self, inputs: StepInputs):
        def to_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=to_device(inputs.slot_mapping),
            block_tables=to_device(inputs.block_tables),
            seq_lens=to_device(inputs.seq_lens),
            query_start_loc=to_device(inputs.query_start_loc.astype(np.int32)),
            max_query_len=inputs.max_query_len,
        )
        return to_device(inputs.input_ids), to_device(inputs.positions), meta

    def capture_graphs(self) -> float:
        """CUDA graphs for decode and mixed steps (``StepGraphs``); returns seconds spent.
        On CPU nothing to do; with ``enforce_eager`` only the warm-up."""
        if self.device.type != "cuda":
            return 0.0
        start = time.perf_counter()
        if not self.config.enforce_eager:
            before = torch.cuda.memory_reserved(self.device)
            self.graphs = StepGraphs(self)
            # Outside the KV budget: it comes out of the 1 - gpu_memory_utilization margin.
            logger.info(
                "CUDA graphs: %d decode (batch <= %d), %d mixed (tokens <= %d); %.2f GiB",
                len(self.graphs.batch_sizes), self.graphs.batch_sizes[-1],
                len(self.graphs.token_sizes), max(self.graphs.token_sizes, default=0),
                (torch.cuda.memory_reserved(self.device) - before) / _GIB,
            )
        self._warm_up_attention_variants()
        return time.perf_counter() - start

    @torch.inference_mode()
    def _warm_up_attention_variants(self) -> None:
        """Compile every attention variant a step can need before the engine reports
        ready: the kernel is specialised on its tiling and on how many segments the KV
        range is split into, and a variant first met by a request would stall every
        running sequence for the length of a Triton compile (about a second). The kernel
        module lists its own variants (``tilings``); nothing to do without Triton."""
        k_cache, v_cache = self.kv_caches[0]
        ops = kernel_for("attention", k_cache)
        if ops is None:
            return
        layer = self.model.layers[0]
        for decode in (False, True):
            ops.warm_up(k_cache, v_cache, layer.num_heads, layer.scale,
                        self.config.max_num_batched_tokens, decode)  # fmt: skip
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The model over one step's tokens; a negative id stands for a token sampled by the
        previous step that the host has not seen yet (async scheduling), read here from
        ``sampled_ids`` on the device."""
        input_ids = resolve_placeholders(input_ids, self.sampled_ids)
        return self.model(input_ids, positions, self.kv_caches, meta)

    def launch(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        sample_rows: list[int],
        sampling: SamplingMetadata,
    ) -> StepHandle:
        """Compute this step's tokens for every sequence and sample the next token for the
        sequences at ``sample_rows`` (those whose last known token was computed). On a GPU
        this queues the work and returns at once: the host can do other work while it runs
        and collect the sampled tokens with ``result()``."""
        inputs = build_step_inputs(seqs, num_new_tokens, self.block_size)
        return self.launch_inputs(inputs, sample_rows, sampling)

    @torch.inference_mode()
    def launch_inputs(
        self, inputs: StepInputs, sample_rows: list[int], sampling: SamplingMetadata
    ) -> StepHandle:
        """The same from host arrays: what a tensor-parallel worker receives."""
        graphs = self.graphs
        if graphs is not None and graphs.fits(inputs):
            hidden = graphs.run(inputs)
        else:
            input_ids, positions, meta = self._to_device(inputs)
            if inputs.has_placeholders:
                hidden = self.forward(input_ids, positions, meta)
            else:
                hidden = self.model(input_ids, positions, self.kv_caches, meta)
        prompt_logprobs = None
        if sampling.prompt_logprobs:
            prompt_logprobs = compute_prompt_logprobs(
                self.model.compute_logits, hidden, inputs.query_start_loc,
                sampling.prompt_logprobs,
            )  # fmt: skip
        if not sample_rows:
            return StepHandle(None, prompt_logprobs)
        last_rows = inputs.query_start_loc[1:][sample_rows] - 1
        if len(last_rows) == inputs.num_seqs and inputs.max_query_len == 1:
            last_hidden = hidden  # pure decode, every row sampled: no gather
        else:
            last_hidden = hidden[torch.from_numpy(last_rows).to(self.device)]
        logits = self.model.compute_logits(last_hidden)
        sampled = self.sampler.sample(logits, sampling)
        self.sampled_ids[: len(sample_rows)].copy_(sampled.token_ids)
        return StepHandle(sampled.start_copy_to_host(), prompt_logprobs)


class StepHandle:
    """A launched step; ``result()`` waits for its sampled tokens and prompt logprobs
    (None: nothing sampled and no prompt logprobs asked for)."""

    def __init__(self, sampled: SampledTokens | None, prompt_logprobs=None) -> None:
        self._sampled = sampled
        self._prompt_logprobs = prompt_logprobs

    def result(self) -> SamplerOutput | None:
        if self._sampled is None and not self._prompt_logprobs:
            return None
        output = SamplerOutput([], []) if self._sampled is None else self._sampled.to_host()
        if self._prompt_logprobs:
            output.prompt_logprobs = prompt_logprobs_to_host(self._prompt_logprobs)
        return output


def resolve_placeholders(input_ids: torch.Tensor, sampled_ids: torch.Tensor) -> torch.Tensor:
    """Replace each id ``-1 - i`` by ``sampled_ids[i]``; other ids pass through."""
    return torch.where(input_ids < 0, sampled_ids[(-1 - input_ids).clamp_(min=0)], input_ids)


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

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def has_placeholders(self) -> bool:
        return bool(len(self.input_ids)) and int(self.input_ids.min()) < 0


def build_step_inputs(
    seqs: list[Sequence], num_new_tokens: list[int], block_size: int
) -> StepInputs:
    """Vectorised over tokens: Python touches each sequence once, never each token."""
    counts = np.asarray(num_new_tokens, dtype=np.int64)
    starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, len(seqs))
    query_start_loc = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start_loc[1:])
    total = int(query_start_loc[-1])
    row_of_token = np.repeat(np.arange(len(seqs)), counts)
    positions = np.arange(total) - query_start_loc[row_of_token] + starts[row_of_token]
    input_ids = np.fromiter(
        (t for s, c, n in zip(seqs, starts, counts) for t in s.token_ids[c : c + n]),
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
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        seq_lens=(starts + counts).astype(np.int32),
        query_start_loc=query_start_loc,
        block_tables=block_tables,
        max_query_len=int(counts.max()),
    )


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

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        cfg = runner.config
        device = runner.device
        max_bs = cfg.max_num_seqs
        self.batch_sizes = sorted({b for b in DECODE_GRAPH_BATCHES if b <= max_bs} | {max_bs})
        self.token_sizes = [t for t in MIXED_GRAPH_TOKENS if t <= cfg.max_num_batched_tokens]
        self.max_seqs = max_bs + 1  # rows of a mixed step: the sequences, then the padding
        max_tokens = max([max_bs, *self.token_sizes])
        max_blocks = -(-cfg.max_model_len // runner.block_size)
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
        with torch.inference_mode():
            for kind, size in shapes:
                args = self._capture_inputs(kind, size)
                runner.forward(*args)  # compile/warm every kernel outside the capture
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = runner.forward(*args)
                self.graphs[kind, size] = (graph, out)
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
        device = self.runner.device
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
