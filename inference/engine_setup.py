"""How an engine is put together from its config, in one place: the config resolved once
(``resolve_engine_config``: the model's folder and config, the device, dtype, KV-cache dtype
and quantization), and every part built from that resolution (``build_engine``: tokenizer
and stop ids, the model runner (one process or tensor-parallel workers), the KV cache, the
scheduler, block manager, output processor and grammar compiler), with the checks that
reject a configuration before anything large is allocated."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inference.block_manager import BlockManager, prefix_cache_root
from inference.config import EngineConfig, ResolvedEngineConfig
from inference.executor.interface import ModelExecutor
from inference.model_files import load_tokenizer, resolve_model
from inference.models.config import ModelConfig
from inference.output_processor import OutputProcessor
from inference.runner.model_runner import ModelRunner
from inference.scheduler import Scheduler
from inference.spec_decode.draft_model import DraftModelProposer
from inference.spec_decode.eagle import EagleProposer
from inference.structured_output import GrammarCompiler

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """Everything ``LLMEngine`` drives, built by ``build_engine``."""

    tokenizer: Any  # None: the model has no tokenizer files (prompts are token ids)
    eos_token_ids: set[int]
    runner: ModelExecutor
    num_total_blocks: int
    startup_phases: dict[str, float]  # seconds by start-up phase, for the log and /health
    block_manager: BlockManager
    scheduler: Scheduler
    output_processor: OutputProcessor
    grammars: GrammarCompiler
    # Speculative decoding with a draft model or an EAGLE head: the proposer, its KV cache
    # sized beside the target's (None: no speculation, or n-gram lookup).
    draft: DraftModelProposer | EagleProposer | None = None


def resolve_engine_config(config: EngineConfig) -> tuple[ResolvedEngineConfig, Path, ModelConfig]:
    """The config resolved against its model and this host, with the model's folder and
    config. ValueError for a configuration the model or the host cannot run."""
    model_path = resolve_model(config.model)
    model_config = ModelConfig.from_folder(model_path)
    resolved = config.resolve(model_config)
    check_tensor_parallel(resolved, model_config)
    return resolved, model_path, model_config


def build_engine(
    config: ResolvedEngineConfig, model_path: Path, model_config: ModelConfig
) -> EngineParts:
    """Every part of an engine, from its resolved config (``resolve_engine_config``)."""
    tokenizer = load_tokenizer(config.tokenizer or model_path)
    if tokenizer is None:
        logger.warning("%s has no tokenizer files: prompts must be token ids", model_path)
    eos = eos_token_ids(model_path, model_config, tokenizer)
    torch.manual_seed(config.seed)
    speculative = config.speculative()
    # The draft loads first, so that profiling the target's step counts its weights.
    draft = None
    if speculative is not None and speculative.method == "draft_model":
        draft = DraftModelProposer(config, model_config, speculative, tokenizer)
        # Random (dummy) weights of the target as without a draft: a benchmark's two runs,
        # with and without speculation, then serve the same model.
        torch.manual_seed(config.seed)
    runner = make_runner(config, model_config, str(model_path))
    try:
        if speculative is not None and speculative.method in ("eagle", "eagle3"):
            # The head reads the target's embedding and LM head: loaded after the target,
            # before profiling (which then counts its weights). One device (TP is refused).
            assert isinstance(runner, ModelRunner)
            draft = EagleProposer(config, model_config, speculative, runner.model)
        num_blocks, startup_phases = size_kv_cache(runner, config, draft)
    except BaseException:
        runner.close()
        if draft is not None:
            draft.close()
        raise
    block_manager = BlockManager(
        num_blocks, config.block_size, config.enable_prefix_caching,
        prefix_cache_root(
            model=str(model_path), load_format=config.load_format,
            dtype=str(config.torch_dtype), kv_cache_dtype=str(config.kv_cache_torch_dtype),
            quantization=config.quantization,
        ),
    )  # fmt: skip
    return EngineParts(
        tokenizer=tokenizer,
        eos_token_ids=eos,
        runner=runner,
        num_total_blocks=num_blocks,
        startup_phases=startup_phases,
        block_manager=block_manager,
        scheduler=Scheduler(block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                            config.max_loras if config.enable_lora else 0),
        output_processor=OutputProcessor(tokenizer, eos, config.max_model_len),
        # Structured outputs: matchers are built off the step loop.
        grammars=GrammarCompiler(tokenizer, model_config.vocab_size, sorted(eos),
                                 pinned=config.device.startswith("cuda")),
        draft=draft,
    )


def size_kv_cache(
    runner: ModelExecutor, config: ResolvedEngineConfig,
    draft: DraftModelProposer | EagleProposer | None = None,
) -> tuple[int, dict[str, float]]:
    """Profile, allocate the KV cache and capture graphs; returns the block count and the
    seconds of each start-up phase. A draft model's (or EAGLE head's) cache has as many
    blocks as the target's (the target's block ids index both): the budget profiled for the
    target's blocks is shared out by the two models' bytes per block."""
    t0 = time.perf_counter()
    num_blocks = runner.determine_num_blocks()
    if draft is not None and config.num_kv_blocks is None:
        target_bytes = runner.bytes_per_block
        num_blocks = max(1, num_blocks * target_bytes // (target_bytes + draft.bytes_per_block))
    t1 = time.perf_counter()
    check_capacity(config, num_blocks)
    runner.allocate_kv_cache(num_blocks)
    if draft is not None:
        draft.allocate_kv_cache(num_blocks)
    t2 = time.perf_counter()
    capture_s = runner.capture_graphs()
    startup_phases = {
        "load_s": round(runner.load_seconds, 2),
        "profile_s": round(t1 - t0, 2),
        "allocate_s": round(t2 - t1, 2),
        "capture_s": round(capture_s, 2),
    }
    logger.info("start-up by phase: %s", startup_phases)
    logger.info(
        "KV cache: %d blocks of %d tokens (%d tokens, %s, %.2f GiB%s); max concurrency at "
        "max_model_len=%d: %.1f", num_blocks, config.block_size,
        num_blocks * config.block_size, str(config.kv_cache_torch_dtype).removeprefix("torch."),
        num_blocks * runner.bytes_per_block / 2**30,
        " per GPU" if config.tensor_parallel_size > 1 else "",
        config.max_model_len, num_blocks * config.block_size / config.max_model_len,
    )
    return num_blocks, startup_phases


def ensure_writable_kernel_cache() -> None:
    """Compiled kernels go to ``TRITON_CACHE_DIR`` (in Kubernetes a folder of the model cache
    volume, so restarts load them instead of compiling: 12.5 s instead of 27 s to ready for
    the 1.5B on the H200). A folder that cannot be written (a cache volume from before the
    loader made it, a read-only mount) would fail the first compile: compile into a
    temporary folder instead, and say so."""
    path = os.environ.get("TRITON_CACHE_DIR")
    if not path:
        return
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as exc:
        fallback = tempfile.mkdtemp(prefix="pagoda-kernel-cache-")
        logger.warning(
            "kernel cache %s is not writable (%s): compiling into %s instead, so kernels "
            "compile again at every start", path, exc, fallback,
        )
        os.environ["TRITON_CACHE_DIR"] = fallback


def eos_token_ids(path: Path, cfg: ModelConfig, tokenizer) -> set[int]:
    ids = set(cfg.eos_token_ids)
    gen_path = Path(path) / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if eos is not None:
            ids |= {eos} if isinstance(eos, int) else set(eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def check_tensor_parallel(config: ResolvedEngineConfig, cfg: ModelConfig) -> None:
    """ValueError unless the model splits ``tensor_parallel_size`` ways on this host."""
    from inference.parallel_state import check_divisible

    tp = config.tensor_parallel_size
    check_divisible(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, tp)
    if tp > 1 and config.device == "cuda" and torch.cuda.device_count() < tp:
        raise ValueError(
            f"tensor_parallel_size={tp} needs {tp} GPUs; this host has "
            f"{torch.cuda.device_count()}"
        )


def make_runner(
    config: ResolvedEngineConfig, model_config: ModelConfig, model_path: str
) -> ModelExecutor:
    """The model in this process (one device), or tensor-parallel workers behind an
    executor (they hold the shards and offer the runner's methods): either way, what the
    engine drives."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config, model_config, model_path)
    from inference.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, model_config, model_path)


def check_capacity(config: ResolvedEngineConfig, num_blocks: int) -> None:
    capacity = num_blocks * config.block_size
    if capacity < config.max_model_len:
        raise ValueError(
            f"the KV cache holds {capacity} tokens ({num_blocks} blocks of "
            f"{config.block_size}), fewer than max_model_len={config.max_model_len}: one "
            "request could never finish. Lower max_model_len or give the cache more memory "
            "(gpu_memory_utilization, num_kv_blocks)."
        )
