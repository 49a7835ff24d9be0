"""``ModelRunner``: one process's model, its KV cache, and a step from inputs to samples.

Owns the model weights and the KV cache tensors: one (key, value) pair per layer, each
``[num_blocks, block_size, num_kv_heads, head_dim]``; the block ids handed out by the
block manager index their first dimension. Sizes the cache from a profiled run of the
largest step, runs a step (through a CUDA graph when one fits, ``cuda_graphs``, else
eagerly) and samples on the device, so only the chosen ids come back to the host.

What a step is made of lives in ``step_inputs`` and how steps replay as graphs in
``cuda_graphs``, so that this module is only about the model: loading it, sizing memory
for it, and running it. On one GPU the engine drives a ``ModelRunner`` directly; under
tensor parallelism each worker process holds one (``inference.executor``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np
import torch

from inference.config import ResolvedEngineConfig
from inference.layers.attention_metadata import AttentionMetadata
from inference.layers.kv_cache import kv_block_bytes
from inference.lora.device import DeviceLoRAs
from inference.lora.request import LoRARequest
from inference.lora.slots import LoRASlotTable
from inference.model_files import resolve_model
from inference.models.config import ModelConfig
from inference.models.eagle3 import aux_layer_ids
from inference.models.loader import load_model
from inference.parallel_state import SINGLE, ParallelContext, kv_head_range
from inference.runner.cuda_graphs import (
    DECODE_GRAPH_BATCHES,
    MIXED_GRAPH_TOKENS,
    DecodeHead,
    GraphExtension,
    StepGraphs,
)
from inference.runner.step_inputs import StepInputs, build_step_inputs, resolve_placeholders
from inference.sampler import (
    SampledTokens,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    compute_prompt_logprobs,
    prompt_logprobs_to_host,
)
from inference.sequence import Sequence
from inference.spec_decode.rejection import verify_rows
from pagoda_kernels import warm_up_paged_attention
from pagoda_kernels.attention import LongPrefill, find_long_prefills, long_prefill_min_queries

logger = logging.getLogger(__name__)

_GIB = 1 << 30


class ModelRunner:
    # A step's result waits on a CUDA event and reads pinned memory: any thread may.
    concurrent_results = True

    def __init__(
        self,
        config: ResolvedEngineConfig,
        model_config: ModelConfig,
        model_path: str,
        parallel: ParallelContext = SINGLE,
        device: torch.device | None = None,
    ) -> None:
        """``device``: a tensor-parallel rank's own GPU (default: ``config.device``)."""
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.device) if device is None else device
        self.dtype = dtype = config.torch_dtype
        self.kv_cache_dtype = config.kv_cache_torch_dtype
        self.block_size = config.block_size
        # Tensor parallelism: this rank's share of the KV heads (all of them on one GPU).
        self.parallel = parallel
        _, self.num_kv_heads = kv_head_range(
            model_config.num_kv_heads, parallel.rank, parallel.world_size
        )
        # Sequences with this many query tokens in a step run their attention through SDPA
        # (``pagoda_kernels.attention.LongPrefill``), the step eagerly; None: never.
        self.long_prefill_min_queries = long_prefill_min_queries(
            self.device, dtype, model_config.num_heads // parallel.world_size,
            self.num_kv_heads, model_config.head_dim,
        )  # fmt: skip
        start = time.perf_counter()
        self.model = load_model(
            model_path, model_config, dtype, self.device, config.max_model_len, config.load_format,
            parallel, config.quantization,
        )
        self.load_seconds = time.perf_counter() - start
        self.sampler = Sampler()
        # EAGLE drafts from the target's hidden states: each step hands them out
        # (``StepHandle.hidden_states``); otherwise a step keeps no reference to them.
        # EAGLE-3's are the residual stream entering three layers (3 x hidden a token).
        speculative = config.speculative()
        self.keep_hidden_states = speculative is not None and speculative.method in (
            "eagle", "eagle3")  # fmt: skip
        if speculative is not None and speculative.method == "eagle3":
            layers = aux_layer_ids(resolve_model(speculative.model), model_config.num_layers)
            self.model.keep_aux(layers, max(config.max_num_batched_tokens,
                                            config.max_num_seqs))  # fmt: skip
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.graphs: StepGraphs | None = None
        # The last step's sampled ids, where the next step's placeholders read them. Every
        # graph reads this buffer, so it has room for the largest captured batch from the
        # start (8 KiB): raising max_num_seqs live up to it keeps the graphs there are.
        self.sampled_ids = torch.zeros(max(config.max_num_seqs, DECODE_GRAPH_BATCHES[-1]),
                                       dtype=torch.int64, device=self.device)  # fmt: skip
        # LoRA adapters: their device slots, and (on one device) which adapter is in which.
        self.loras: DeviceLoRAs | None = None
        self.lora_table: LoRASlotTable | None = None
        if config.enable_lora:
            self.loras = DeviceLoRAs(
                self.model, model_config, config.max_loras, config.max_lora_rank,
                config.cpu_lora_capacity,
                max(config.max_num_batched_tokens, config.max_num_seqs), dtype, self.device,
            )  # fmt: skip
            self.lora_table = LoRASlotTable(config.max_loras)
            logger.info("LoRA: %d slots of rank %d, %.1f MiB", config.max_loras,
                        config.max_lora_rank, self.loras.bytes / 2**20)  # fmt: skip

    # -- KV cache sizing ---------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        cfg = self.model_config
        return kv_block_bytes(cfg.num_layers, self.block_size, self.num_kv_heads, cfg.head_dim,
                              self.kv_cache_dtype)  # fmt: skip

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
        long_prefills = find_long_prefills(
            np.array([0, num_tokens]), np.array([num_tokens]), self.long_prefill_min_queries)
        return AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=self.device),
            block_tables=torch.arange(max_blocks, device=self.device, dtype=torch.int32)[None],
            seq_lens=torch.tensor([num_tokens], device=self.device, dtype=torch.int32),
            query_start_loc=torch.tensor([0, num_tokens], device=self.device, dtype=torch.int32),
            max_query_len=num_tokens,
            long_prefills=long_prefills,
        )

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.model_config
        shape = (num_blocks, self.block_size, self.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
            )
            for _ in range(cfg.num_layers)
        ]
        self.num_blocks = num_blocks

    def close(self) -> None:
        """Drop the weights, KV cache and CUDA graphs (the tensor-parallel executor's
        counterpart stops its workers); the memory is freed once nothing refers to it."""
        self.graphs = None
        self.kv_caches = []
        self.model = None
        if self.loras is not None:
            self.loras.close()
            self.loras = None

    @property
    def dead_reason(self) -> str | None:
        """None: the model runs in this process, with no worker that could die under it
        (the tensor-parallel executor's counterpart reports a dead worker)."""
        return None

    # -- live reconfiguration (``inference.reconfigure``) --------------------------------
    def graph_limits(self) -> tuple[int, int] | None:
        """The largest captured decode batch and mixed-step token count (None: no graphs,
        as on CPU or with ``enforce_eager``)."""
        graphs = self.graphs
        if graphs is None:
            return None
        return graphs.batch_sizes[-1], max(graphs.token_sizes, default=0)

    def set_batch_limits(self, max_num_seqs: int, max_num_batched_tokens: int) -> bool:
        """The scheduler's new limits. Returns True when the captured graphs must be made
        again: the buffer of sampled ids they read grew (past 1024 sequences)."""
        self.config = replace(self.config, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens)  # fmt: skip
        if max_num_seqs <= len(self.sampled_ids):
            return False
        # No step is in flight (the engine settles first): no placeholder reads the old one.
        grown = torch.zeros(max_num_seqs, dtype=torch.int64, device=self.device)
        grown[: len(self.sampled_ids)].copy_(self.sampled_ids)
        self.sampled_ids = grown
        return self.graphs is not None

    def blocks_at_memory_utilization(self, utilization: float) -> int:
        """The KV blocks ``gpu_memory_utilization=utilization`` allows, from the blocks
        held now and the card's size (what is not the KV cache stays as it is). On CPU the
        cache is sized by ``cpu_kv_cache_gib``: the block count does not change."""
        if self.device.type != "cuda":
            return self.num_blocks
        _, total = torch.cuda.mem_get_info(self.device)
        delta = (utilization - self.config.gpu_memory_utilization) * total
        return max(1, self.num_blocks + int(delta // self.bytes_per_block))

    def capture_missing_graphs(
        self, max_num_seqs: int, max_num_batched_tokens: int
    ) -> BackgroundGraphs | None:
        """The graphs that these limits need and the runner lacks, to be recorded in the
        background while steps replay the ones it has (``GraphExtension``); None where all
        of them must be captured again instead (there are none, or the sampled-ids buffer
        that every graph reads must grow). Called on the stepping thread between steps:
        new sizes whose kernels never ran get their eager warm-up here, and so do the
        attention variants of a larger step budget."""
        graphs = self.graphs
        if graphs is None or max_num_seqs > len(self.sampled_ids):
            return None
        extension = GraphExtension(graphs, max_num_seqs, max_num_batched_tokens)
        extension.warm_up()
        if max_num_batched_tokens > self.config.max_num_batched_tokens:
            self._warm_up_attention_variants(max_num_batched_tokens)
        return BackgroundGraphs(self, extension)

    @torch.inference_mode()
    def resize_kv_cache(self, num_blocks: int, moves: list[tuple[int, int]]) -> None:
        """``num_blocks`` blocks per layer, after copying each (from, to) block of
        ``moves``; blocks below both sizes keep their content. One layer at a time, so the
        peak is the cache plus one layer's. The graphs read the old tensors: dropped here,
        captured again by the caller."""
        self.graphs = None
        keep = min(num_blocks, self.num_blocks)
        if moves:
            src = torch.tensor([m[0] for m in moves], device=self.device)
            dst = torch.tensor([m[1] for m in moves], device=self.device)
        for i, layer in enumerate(self.kv_caches):
            resized = []
            for cache in layer:
                if moves:  # as bytes: index_put has no float8 kernel
                    raw = cache.view(torch.uint8)
                    raw[dst] = raw[src]
                new = torch.zeros((num_blocks, *cache.shape[1:]), dtype=cache.dtype,
                                  device=self.device)  # fmt: skip
                new[:keep].copy_(cache[:keep])
                resized.append(new)
            self.kv_caches[i] = (resized[0], resized[1])
            del layer, resized
        self.num_blocks = num_blocks
        self.config = replace(self.config, num_kv_blocks=num_blocks)

    # -- one step ----------------------------------------------------------------------
    def _to_device(self, inputs: StepInputs, long_prefills: tuple[LongPrefill, ...] = ()):
        def to_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=to_device(inputs.slot_mapping),
            block_tables=to_device(inputs.block_tables),
            seq_lens=to_device(inputs.seq_lens),
            query_start_loc=to_device(inputs.query_start_loc.astype(np.int32)),
            max_query_len=inputs.max_query_len,
            long_prefills=long_prefills,
        )
        return to_device(inputs.input_ids), to_device(inputs.positions), meta

    def capture_graphs(self, decode_head: DecodeHead | None = None) -> float:
        """CUDA graphs for decode and mixed steps (``StepGraphs``); returns seconds spent.
        On CPU nothing to do; with ``enforce_eager`` only the warm-up. ``decode_head``: the
        decode graphs end in it (a draft model's pick), so a decode step that replays one
        returns the head's output, not hidden states."""
        if self.device.type != "cuda":
            return 0.0
        start = time.perf_counter()
        if not self.config.enforce_eager:
            if self.loras is not None:
                self.loras.capturing()
            before = torch.cuda.memory_reserved(self.device)
            # Block tables as wide as the longest sequence, and as the largest mixed graph
            # (recorded with all its tokens in one row, which reads that many blocks' worth
            # of its table: past a narrower table's end when max_model_len is short).
            width = max(self.config.max_model_len, MIXED_GRAPH_TOKENS[-1])
            self.graphs = StepGraphs(
                self.forward, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                -(-width // self.block_size), self.device, decode_head,
            )  # fmt: skip
            # Outside the KV budget: it comes out of the 1 - gpu_memory_utilization margin.
            logger.info(
                "CUDA graphs: %d decode (batch <= %d), %d mixed (tokens <= %d); %.2f GiB; "
                "%.2f s eager warm-up runs, %.2f s recording",
                len(self.graphs.batch_sizes), self.graphs.batch_sizes[-1],
                len(self.graphs.token_sizes), max(self.graphs.token_sizes, default=0),
                (torch.cuda.memory_reserved(self.device) - before) / _GIB,
                self.graphs.eager_seconds, self.graphs.record_seconds,
            )
        warm_start = time.perf_counter()
        self._warm_up_attention_variants(self.config.max_num_batched_tokens)
        logger.info("attention variants warmed in %.2f s", time.perf_counter() - warm_start)
        return time.perf_counter() - start

    @torch.inference_mode()
    def _warm_up_attention_variants(self, max_num_batched_tokens: int) -> None:
        """Compile every attention variant a step can need before the engine reports
        ready: the kernel is specialised on its tiling and on how many segments the KV
        range is split into, and a variant first met by a request would stall every
        running sequence for the length of a Triton compile (about a second). The kernel
        module lists its own variants; nothing to do without Triton. An FP8 cache is its own
        variant of each, compiled here with the model's query dtype."""
        k_cache, v_cache = self.kv_caches[0]
        layer = self.model.layers[0]
        warmed = [
            warm_up_paged_attention(k_cache, v_cache, layer.num_heads, layer.scale,
                                    max_num_batched_tokens, decode, self.dtype,
                                    layer.k_scale, layer.v_scale)
            for decode in (False, True)
        ]  # fmt: skip
        if any(warmed) and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The model over one step's tokens; a negative id stands for a token sampled by the
        previous step that the host has not seen yet (async scheduling), read here from
        ``sampled_ids`` on the device."""
        input_ids = resolve_placeholders(input_ids, self.sampled_ids)
        return self.model(input_ids, positions, self.kv_caches, meta)

    @torch.inference_mode()
    def run_model(self, inputs: StepInputs) -> torch.Tensor:
        """The model's final hidden states over a step's tokens: through a captured graph
        where one fits, else eagerly."""
        long_prefills = ()
        minimum = self.long_prefill_min_queries
        if minimum is not None and inputs.max_query_len >= minimum:
            long_prefills = find_long_prefills(inputs.query_start_loc, inputs.seq_lens, minimum)
        graphs = self.graphs
        if graphs is not None and not long_prefills and graphs.fits(inputs):
            return graphs.run(inputs)
        input_ids, positions, meta = self._to_device(inputs, long_prefills)
        if inputs.has_placeholders:
            return self.forward(input_ids, positions, meta)
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
        inputs = build_step_inputs(seqs, num_new_tokens, self.block_size, self.lora_table)
        return self.launch_inputs(inputs, sample_rows, sampling)

    def prefetch_lora(self, request: LoRARequest) -> None:
        """A request with this adapter arrived: read its tensors off the step loop."""
        if self.loras is not None:
            self.loras.prefetch(request)

    def forget_lora(self, request: LoRARequest) -> None:
        """An adapter was unloaded: drop it from the slots and the CPU cache."""
        if self.lora_table is not None:
            self.lora_table.forget(request)
        if self.loras is not None:
            self.loras.forget(request)

    @torch.inference_mode()
    def launch_inputs(
        self, inputs: StepInputs, sample_rows: list[int], sampling: SamplingMetadata
    ) -> StepHandle:
        """The same from host arrays: what a tensor-parallel worker receives."""
        if self.loras is not None:
            self.loras.stage(inputs.lora_slots, inputs.lora_loads)
        # A step that verifies drafts (queries of up to k + 1 tokens a row) replays a mixed
        # step's graph like any step of that many tokens.
        verifying = sampling.draft_token_ids is not None
        hidden = self.run_model(inputs)
        prompt_logprobs = None
        if sampling.prompt_logprobs:
            prompt_logprobs = compute_prompt_logprobs(
                self.model.compute_logits, hidden, inputs.query_start_loc,
                sampling.prompt_logprobs,
            )  # fmt: skip
        kept = None
        if self.keep_hidden_states:
            aux = self.model.aux_states
            kept = hidden if aux is None else aux[: hidden.shape[0]].flatten(1)
        if not sample_rows:
            return StepHandle(None, prompt_logprobs, kept)
        last_rows = inputs.query_start_loc[1:][sample_rows] - 1
        if verifying:  # every position of each row's drafts, and the one after them
            num_drafts = np.fromiter(map(len, sampling.draft_token_ids), np.int64)
            last_rows = verify_rows(last_rows, num_drafts)
        if len(last_rows) == inputs.num_seqs and inputs.max_query_len == 1:
            last_hidden = hidden  # pure decode, every row sampled: no gather
        else:
            rows = torch.from_numpy(last_rows)
            if self.device.type == "cuda":
                # From pinned memory: a copy from pageable memory waits for the stream, so
                # the host would sit out this step's forward instead of preparing the next.
                rows = rows.pin_memory()
            last_hidden = hidden[rows.to(self.device, non_blocking=True)]
        logits = self.model.compute_logits(last_hidden)
        sampled = self.sampler.sample(logits, sampling)
        if not verifying:
            self.sampled_ids[: len(sample_rows)].copy_(sampled.token_ids)
        else:  # each row's last pick (all its drafts accepted: the token after them)
            ends = torch.from_numpy(np.cumsum(num_drafts + 1) - 1)
            if self.device.type == "cuda":
                ends = ends.pin_memory()
            self.sampled_ids[: len(sample_rows)].copy_(
                sampled.token_ids[ends.to(self.device, non_blocking=True)])
        return StepHandle(sampled.start_copy_to_host(), prompt_logprobs, kept)


class BackgroundGraphs:
    """A ``GraphExtension`` as ``inference.reconfigure`` drives it: ``run`` on the capture
    thread, ``cancel`` from any thread, ``install`` on the stepping thread between steps."""

    def __init__(self, runner: ModelRunner, extension: GraphExtension) -> None:
        self.runner, self.extension = runner, extension
        self.num_graphs = len(extension.shapes)

    def run(self) -> None:
        start = time.perf_counter()
        self.extension.record()
        logger.info("CUDA graphs: %d recorded in the background in %.2f s (%.2f s warm-up "
                    "between steps before)", self.num_graphs, time.perf_counter() - start,
                    self.extension.warm_up_seconds)  # fmt: skip

    def cancel(self) -> None:
        self.extension.cancel()

    def install(self) -> None:
        self.runner.graphs = self.extension.merged()


class StepHandle:
    """A launched step; ``result()`` waits for its sampled tokens and prompt logprobs
    (None: nothing sampled and no prompt logprobs asked for). ``hidden_states``: the
    model's final hidden states (after the final norm: what the LM head reads), one row
    per token of the step in input order, where the runner keeps them (EAGLE); a graph's
    buffer, so valid until the next step is launched."""

    def __init__(
        self, sampled: SampledTokens | None, prompt_logprobs=None,
        hidden_states: torch.Tensor | None = None,
    ) -> None:
        self._sampled = sampled
        self._prompt_logprobs = prompt_logprobs
        self.hidden_states = hidden_states

    def result(self) -> SamplerOutput | None:
        if self._sampled is None and not self._prompt_logprobs:
            return None
        output = SamplerOutput([], []) if self._sampled is None else self._sampled.to_host()
        if self._prompt_logprobs:
            output.prompt_logprobs = prompt_logprobs_to_host(self._prompt_logprobs)
        return output
