"""Every engine setting in one place: its type, default, check and command-line flag.

``EngineConfig`` is the one declaration. Each field's metadata carries its flag (vLLM's
spelling, so ``LLM(model, **kwargs)``, ``pagoda serve`` flags and the operator's
LLMDeployment fields map one to one), help text and choices; ``add_engine_args`` turns
them into argparse arguments for every command line (serve, bench, chat), and
``engine_kwargs`` reads the given ones back. A flag a user leaves out is absent from the
kwargs, so its default is the dataclass's and nowhere else.

``EngineConfig.resolve`` fills what depends on the model and the host (the device, the
dtype, the quantization, lengths, batch limits) into a new frozen ``ResolvedEngineConfig``,
which the engine and everything below it read, decided once; the user's config is never
written to (as vLLM V1 resolves one ``VllmConfig``). It holds no torch objects (the server
unpickles it without torch); ``torch_dtype`` and ``kv_cache_torch_dtype`` name them.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from inference.quantization import QUANTIZATION_METHODS, check_sharding, resolve_quantization
from inference.spec_decode.config import SpeculativeConfig, parse_speculative_config

if TYPE_CHECKING:
    import torch

    from inference.models.config import ModelConfig

KV_CACHE_DTYPES = ("auto", "fp8")
# dtype spellings -> the torch name each stands for.
_DTYPE_NAMES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}  # fmt: skip
_DTYPES = ("auto", *_DTYPE_NAMES)

# Batch limits when none are given: what an H100/H200-class card sustains (measured in
# benchmarks/results), and what a CPU steps through without long stalls.
DEFAULT_MAX_NUM_SEQS = {"cuda": 1024, "cpu": 256}
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cuda": 16384, "cpu": 2048}


def _flag(help: str, *, choices: tuple[str, ...] | None = None,
          aliases: tuple[str, ...] = (), no_effect: str | None = None) -> dict[str, Any]:
    """Field metadata: the command-line side of a setting (the flag is the field's name
    in kebab case, as vLLM spells it; bools get ``--x/--no-x``). ``no_effect``: why a
    vLLM setting changes nothing here; it is accepted, so that vLLM command lines and
    ``LLM(...)`` calls run unchanged, and this sentence is logged when it is given."""
    return {"help": help, "choices": choices, "aliases": aliases, "no_effect": no_effect}


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tokenizer: str | None = field(
        default=None, metadata=_flag("tokenizer folder (default: the model's own)"))
    served_model_name: str | None = None  # each CLI names the model its own way
    tensor_parallel_size: int = field(
        default=1, metadata=_flag("GPUs to shard the model over (1, 2, 4 or 8)",
                                  aliases=("-tp",)))
    gpu_memory_utilization: float = field(
        default=0.9, metadata=_flag("fraction of GPU memory for weights, activations and "
                                    "the KV cache"))
    max_num_seqs: int | None = field(
        default=None, metadata=_flag(
            "most sequences in one step (default: 1024 on a GPU, 256 on CPU, and never "
            "above --max-num-batched-tokens)"))
    max_num_batched_tokens: int | None = field(
        default=None, metadata=_flag(
            "token budget of one step; longer prompts are prefilled in chunks (default: "
            "16384 on a GPU, 2048 on CPU, and never below --max-num-seqs)"))
    block_size: int = field(
        default=16, metadata=_flag("tokens per KV-cache block (a power of two up to 256)"))
    kv_cache_dtype: str = field(
        default="auto", metadata=_flag(
            "KV-cache dtype: auto keeps keys and values in the model's dtype; fp8 stores them "
            "as float8_e4m3 with a per-layer scale (the checkpoint's k_scale/v_scale, else "
            "1.0): twice the tokens in the same memory", choices=KV_CACHE_DTYPES))
    max_model_len: int | None = field(
        default=None, metadata=_flag("longest prompt plus output (default: the model's limit)"))
    enable_prefix_caching: bool = field(
        default=True, metadata=_flag("reuse the KV cache of shared prompt prefixes"))
    enforce_eager: bool = field(
        default=False, metadata=_flag("no CUDA graphs (faster start-up, slower decode)"))
    dtype: str = field(
        default="auto", metadata=_flag("weight and activation dtype (auto: the model's, "
                                       "float32 on CPU)", choices=_DTYPES))
    quantization: str | None = field(
        default=None, metadata=_flag(
            "weight quantization: fp8 quantizes a bf16/fp16/fp32 checkpoint's linear "
            "projections to float8_e4m3 at load (per-channel weight scales, per-token dynamic "
            "activation scales); default: the checkpoint's own (FP8 checkpoints in the Hugging "
            "Face fp8 or compressed-tensors format load as fp8; 4-bit AWQ, GPTQ and "
            "compressed-tensors W4A16 checkpoints as awq, gptq, compressed-tensors)",
            choices=QUANTIZATION_METHODS))
    seed: int = field(default=0, metadata=_flag("random seed of the engine"))
    device: str = field(
        default="auto", metadata=_flag("where the engine runs (auto: a GPU when there is one)",
                                       choices=("auto", "cuda", "cpu")))
    num_kv_blocks: int | None = field(
        default=None, metadata=_flag("pin the KV-cache size in blocks (default: size it "
                                     "from free memory)"))
    cpu_kv_cache_gib: float = field(
        default=2.0, metadata=_flag("KV-cache budget on CPU, where there is no memory "
                                    "profile (GiB)"))
    load_format: str = field(
        default="auto", metadata=_flag("auto: safetensors from the folder; dummy: random "
                                       "weights (implied for the named benchmark shapes)",
                                       choices=("auto", "dummy")))
    # Launch step n+1 before step n's sampled tokens reach the host, so that host work
    # overlaps the GPU's (one wasted token of compute when a sequence stops early).
    async_scheduling: bool = field(
        default=True, metadata=_flag("schedule step n+1 while step n runs on the GPU"))

    # Default sampling parameters, as vLLM's --generation-config and
    # --override-generation-config (see inference.generation_defaults).
    generation_config: str = field(
        default="auto", metadata=_flag(
            "default sampling parameters of requests that leave them out: auto, the model's "
            "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
            "max_new_tokens); vllm, none; or a folder holding a generation_config.json"))
    override_generation_config: str | None = field(
        default=None, metadata=_flag(
            'a JSON object over those defaults, e.g. \'{"temperature": 0.5}\''))
    speculative_config: str | None = field(
        default=None, metadata=_flag(
            'speculative decoding, a JSON object as vLLM\'s: \'{"method": "ngram", '
            '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
            "(n-gram prompt lookup), or '{\"method\": \"draft_model\", \"model\": PATH, "
            "\"num_speculative_tokens\": 4}' (a draft model sharing the target's tokenizer), "
            "or '{\"method\": \"eagle\", \"model\": PATH, \"num_speculative_tokens\": 3}' (an "
            "EAGLE-1/2 head trained for the target); "
            "optional disable_by_batch_size, default 32: no drafts in steps with more "
            "running sequences"))
    # Multi-LoRA (vLLM's flags): adapters are named per request (LoRARequest, the HTTP
    # API's "model", --lora-modules); their tensors sit in max_loras device slots.
    enable_lora: bool = field(
        default=False, metadata=_flag("serve LoRA adapters of the model (PEFT folders)"))
    max_loras: int = field(
        default=1, metadata=_flag("most distinct LoRA adapters in one step (device slots)"))
    max_lora_rank: int = field(
        default=16, metadata=_flag("highest LoRA rank an adapter may have (slots are "
                                   "allocated at this rank)"))
    max_cpu_loras: int | None = field(
        default=None, metadata=_flag("LoRA adapters kept loaded in CPU memory, least recently "
                                     "used out first (default: --max-loras)"))
    max_logprobs: int = field(
        default=20, metadata=_flag("most logprobs (and top_logprobs) a request may ask for; "
                                   "-1: no limit"))
    # vLLM settings that do not apply to this engine: accepted, and their reason logged.
    trust_remote_code: bool = field(
        default=False, metadata=_flag(
            "accepted for vLLM compatibility", no_effect=(
                "--trust-remote-code has no effect: pagoda runs its own implementation of each "
                "supported architecture and never runs code shipped with a checkpoint")))
    revision: str | None = field(
        default=None, metadata=_flag(
            "accepted for vLLM compatibility", no_effect=(
                "--revision has no effect: the engine loads the model folder as it is on disk "
                "(fetch a revision with `pagoda download hf://ORG/NAME@REVISION DIR`)")))
    tokenizer_revision: str | None = field(
        default=None, metadata=_flag(
            "accepted for vLLM compatibility", no_effect=(
                "--tokenizer-revision has no effect: the tokenizer is read from its folder as "
                "it is on disk")))
    download_dir: str | None = field(
        default=None, metadata=_flag(
            "accepted for vLLM compatibility", no_effect=(
                "--download-dir has no effect: the engine never downloads; it loads a local "
                "folder (fill one with `pagoda download URI DIR`)")))
    swap_space: float | None = field(
        default=None, metadata=_flag(
            "accepted for vLLM compatibility", no_effect=(
                "--swap-space has no effect: a preempted sequence's KV cache is recomputed, "
                "not swapped to CPU memory (as in vLLM V1), so no swap space is allocated")))
    enable_chunked_prefill: bool | None = field(
        default=None, metadata=_flag(
            "long prompts are always prefilled in chunks of --max-num-batched-tokens "
            "(--no-enable-chunked-prefill is refused)"))

    def __post_init__(self) -> None:
        self.validate()

    def ignored_settings(self) -> list[str]:
        """Why each given vLLM setting that does not apply here changes nothing."""
        return [
            f.metadata["no_effect"] for f in fields(self)
            if f.metadata.get("no_effect") and getattr(self, f.name) not in (None, False)
        ]  # fmt: skip

    def override_generation_dict(self) -> dict[str, Any]:
        """``override_generation_config`` as a dict (a JSON object given as text or a
        dict, as vLLM's ``LLM(override_generation_config={...})``)."""
        value = self.override_generation_config
        if value is None:
            return {}
        if isinstance(value, dict):
            return dict(value)
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"override_generation_config is not JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise ValueError("override_generation_config must be a JSON object, got "
                             f"{value!r}")
        return parsed

    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` (JSON text or a dict) parsed; None when off."""
        return parse_speculative_config(self.speculative_config)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"unknown engine argument(s) {unknown}; known: {sorted(known - {'model'})}"
            )
        return cls(model=model, **kwargs)

    def resolve(
        self, model_config: ModelConfig, device_type: str | None = None
    ) -> ResolvedEngineConfig:
        """This config with the model's and the device's choices filled in.

        ``device_type``: "cuda" or "cpu", where ``device="auto"`` runs (default: a GPU when
        this host has one). ValueError if ``device="cuda"`` finds no GPU, if
        ``max_model_len`` exceeds what the model can attend to, or if the
        checkpoint's quantization is not supported (a quantized checkpoint sets
        ``quantization``: see ``inference.quantization``). A batch limit
        left out defers to the other one given: a small token budget lowers the default
        ``max_num_seqs`` to it (a step could not hold more sequences anyway), and a large
        ``max_num_seqs`` raises the default budget to it."""
        limit = model_config.max_position_embeddings
        if model_config.sliding_window:  # no sliding-window attention: stay inside it
            limit = min(limit, model_config.sliding_window)
        if self.max_model_len is not None and self.max_model_len > limit:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's limit of {limit} tokens"
            )
        on = _resolve_device(self.device, device_type)
        max_num_seqs = self.max_num_seqs
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_seqs is None:
            max_num_seqs = min(DEFAULT_MAX_NUM_SEQS[on],
                               max_num_batched_tokens or DEFAULT_MAX_NUM_SEQS[on])
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(DEFAULT_MAX_NUM_BATCHED_TOKENS[on], max_num_seqs)
        given = {f.name: getattr(self, f.name) for f in fields(EngineConfig)}
        check_sharding(model_config.quantization_config, model_config, self.tensor_parallel_size)
        return ResolvedEngineConfig(**{
            **given,
            "max_model_len": self.max_model_len or limit,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "device": on,
            "dtype": _resolve_dtype(self.dtype, model_config.torch_dtype, on),
            "quantization": resolve_quantization(self.quantization,
                                                 model_config.quantization_config),
        })

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
        if (self.max_num_seqs is not None and self.max_num_batched_tokens is not None
                and self.max_num_batched_tokens < self.max_num_seqs):
            # As vLLM: a step schedules at least one token per running sequence.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATION_METHODS)} or "
                             f"unset, got {self.quantization!r}")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be auto, cuda or cpu, got {self.device!r}")
        if self.enable_chunked_prefill is False:
            raise ValueError(
                "enable_chunked_prefill=False (--no-enable-chunked-prefill) is not supported: "
                "pagoda always prefills long prompts in chunks of max_num_batched_tokens; to "
                "prefill every prompt in one step, set --max-num-batched-tokens to "
                "--max-model-len")
        self._validate_lora()
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= -1, got {self.max_logprobs}")
        self.override_generation_dict()  # malformed JSON fails here, not at the first request
        speculative = self.speculative()
        if (speculative is not None and speculative.method != "ngram"
                and self.tensor_parallel_size > 1):
            raise ValueError(
                f"speculative_config method {speculative.method!r} with tensor_parallel_size "
                "> 1 is not supported yet: the draft runs in the engine process, beside no "
                "shard of the target; n-gram lookup (method 'ngram') runs at any "
                "tensor_parallel_size")
        if speculative is not None and self.enable_lora:
            raise ValueError(
                "speculative_config with enable_lora is not supported yet: the draft and "
                "verify steps run the base model only; serve adapters without speculation")

    def _validate_lora(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be from 1 to 512, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")

    @property
    def cpu_lora_capacity(self) -> int:
        """Adapters the CPU cache holds (``max_cpu_loras``, default ``max_loras``)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True, kw_only=True)
class ResolvedEngineConfig(EngineConfig):
    """An ``EngineConfig`` after ``resolve``: the lengths and batch limits are numbers,
    ``device`` is "cuda" or "cpu", ``dtype`` a torch dtype's name ("bfloat16"), and
    ``quantization`` the scheme the weights run with (the checkpoint's own, if any)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int

    @property
    def torch_dtype(self) -> torch.dtype:
        """Weights and activations."""
        import torch

        return getattr(torch, self.dtype)

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The KV cache's: the model's dtype, or float8_e4m3fn (``kv_cache_dtype="fp8"``:
        half the bytes)."""
        from pagoda_kernels.kv_cache import FP8_KV_DTYPE

        return FP8_KV_DTYPE if self.kv_cache_dtype == "fp8" else self.torch_dtype


def _resolve_device(device: str, host_device_type: str | None) -> str:
    """Where the engine runs: "cuda" or "cpu"."""
    if device == "cpu":
        return "cpu"
    if host_device_type is None:
        import torch

        host_device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and host_device_type != "cuda":
        raise ValueError("device='cuda' was requested but no CUDA GPU is available")
    return host_device_type


def _resolve_dtype(dtype: str, checkpoint_dtype: str | None, device_type: str) -> str:
    """The torch name of the weights' dtype: the one asked for; with "auto", the
    checkpoint's (bfloat16 for a float32 or unnamed one) on a GPU, float32 on CPU."""
    if dtype != "auto":
        return _DTYPE_NAMES[dtype]
    if device_type == "cpu":
        return "float32"  # CPU matmuls in half precision are slow and less exact
    checkpoint = _DTYPE_NAMES.get(str(checkpoint_dtype), "bfloat16")
    return "bfloat16" if checkpoint == "float32" else checkpoint


def add_engine_args(parser: argparse.ArgumentParser,
                    exclude: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """One flag per ``EngineConfig`` field that has flag metadata, less ``exclude``.

    Every flag defaults to None (not given), so that ``engine_kwargs`` leaves the default
    to ``EngineConfig``; the help text shows that default. A command line that wants
    another default says so with ``parser.set_defaults``."""
    group = parser.add_argument_group("engine")
    for f in fields(EngineConfig):
        if "help" not in f.metadata or f.name in exclude:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"]
        if f.metadata.get("no_effect"):
            help_text += ": " + f.metadata["no_effect"].split(": ", 1)[-1]
        if f.default not in (None, MISSING):
            help_text += f" (default: {f.default})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
        if f.type in _BOOL_TYPES:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _ARG_TYPES[str(f.type)]
            if f.metadata["choices"]:
                kwargs["choices"] = f.metadata["choices"]
        group.add_argument(flag, *f.metadata["aliases"], **kwargs)
    return parser


_ARG_TYPES = {"str | None": str, "str": str, "int": int, "int | None": int,
              "float": float, "float | None": float}
_BOOL_TYPES = ("bool", bool, "bool | None")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings given on a command line built by ``add_engine_args``."""
    return {
        f.name: getattr(args, f.name)
        for f in fields(EngineConfig)
        if "help" in f.metadata and getattr(args, f.name, None) is not None
    }
