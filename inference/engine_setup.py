"""How an engine is put together from its config: tokenizer and stop ids, device and
dtype, lengths and batch limits, the model runner (one process or tensor-parallel workers),
and the checks that reject a configuration before anything large is allocated."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from inference.config import EngineConfig, ResolvedEngineConfig
from inference.executor.interface import ModelExecutor
from inference.models.config import ModelConfig
from inference.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


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


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "cpu":
        return torch.device("cpu")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA GPU is available")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_tensor_parallel(config: EngineConfig, cfg: ModelConfig, device: torch.device) -> None:
    """ValueError unless the model splits ``tensor_parallel_size`` ways on this host."""
    from inference.parallel_state import check_divisible

    tp = config.tensor_parallel_size
    check_divisible(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, tp)
    if tp > 1 and device.type == "cuda" and torch.cuda.device_count() < tp:
        raise ValueError(
            f"tensor_parallel_size={tp} needs {tp} GPUs; this host has "
            f"{torch.cuda.device_count()}"
        )


def make_runner(config, model_config, model_path, device, dtype) -> ModelExecutor:
    """The model in this process (one device), or tensor-parallel workers behind an
    executor: either way, what the engine drives."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config, model_config, model_path, device, dtype)
    from inference.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, model_config, model_path, device, dtype)


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # CPU matmuls in half precision are slow and less exact
    config_dtype = _DTYPES.get(str(cfg.torch_dtype), torch.bfloat16)
    return torch.bfloat16 if config_dtype == torch.float32 else config_dtype


def check_capacity(config: ResolvedEngineConfig, num_blocks: int) -> None:
    capacity = num_blocks * config.block_size
    if capacity < config.max_model_len:
        raise ValueError(
            f"the KV cache holds {capacity} tokens ({num_blocks} blocks of "
            f"{config.block_size}), fewer than max_model_len={config.max_model_len}: one "
            "request could never finish. Lower max_model_len or give the cache more memory "
            "(gpu_memory_utilization, num_kv_blocks)."
        )
