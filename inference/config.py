"""Every engine knob in one place, validated before anything is loaded.

Names follow vLLM's engine arguments, so ``LLM(model, **kwargs)``, ``pagoda serve`` flags
and the operator's LLMDeployment fields map one to one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp32", "fp16", "bf16", "half", "float")


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None
    served_model_name: str | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    # None: 1024 sequences and 16384 tokens a step on a GPU (what an H100/H200-class card
    # sustains; measured in inference/bench/results), 256 and 2048 on CPU.
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    max_model_len: int | None = None  # None: from the model's config
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    dtype: str = "auto"
    seed: int = 0
    device: str = "auto"  # auto | cuda | cpu
    num_kv_blocks: int | None = None  # pin the KV-cache size (blocks); None: size from memory
    cpu_kv_cache_gib: float = 2.0  # KV budget on CPU, where there is no memory profile
    load_format: str = "auto"  # auto: safetensors from the folder; dummy: random weights
    # Launch step n+1 before step n's sampled tokens reach the host, so that host work
    # overlaps the GPU's (one wasted token of compute when a sequence stops early).
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"unknown engine argument(s) {unknown}; known: {sorted(known - {'model'})}"
            )
        return cls(model=model, **kwargs)

    def validate(self) -> None:
        if self.tensor_parallel_size not in (1, 2, 4, 8):
            raise ValueError(
                f"tensor_parallel_size must be 1, 2, 4 or 8, got {self.tensor_parallel_size}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        bs = self.block_size
        if not isinstance(bs, int) or bs < 1 or bs > 256 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two from 1 to 256, got {bs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be auto, cuda or cpu, got {self.device!r}")
