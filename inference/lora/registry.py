"""The engine's side of LoRA: which adapters requests may name (each checked once, from its
folder, before a request with it is queued), unloading one, and what the
``vllm:lora_requests_info`` gauge reports."""

from __future__ import annotations

from collections.abc import Iterable

from inference.lora.peft import inspect_adapter
from inference.lora.request import LoRARequest
from inference.models.config import ModelConfig


class LoRARegistry:
    def __init__(self, enabled: bool, model_config: ModelConfig, max_rank: int) -> None:
        self.enabled = enabled
        self.model_config = model_config
        self.max_rank = max_rank
        self.checked: dict[int, LoRARequest] = {}  # by lora_int_id

    def check(self, request: LoRARequest | None) -> None:
        """ValueError (changing nothing) unless requests may run with this adapter."""
        if request is None:
            return
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        if not self.enabled:
            raise ValueError(f"LoRA adapter {request.lora_name!r} requested, but LoRA is not "
                             "enabled: start the engine with enable_lora=True (--enable-lora)")
        known = self.checked.get(request.lora_int_id)
        if known == request:
            return
        if known is not None:
            raise ValueError(
                f"lora_int_id {request.lora_int_id} already names adapter {known.lora_name!r} "
                f"({known.lora_path}); unload it first or give {request.lora_name!r} its own id")
        inspect_adapter(request.lora_path, self.model_config, self.max_rank)
        self.checked[request.lora_int_id] = request

    def remove(self, lora_int_id: int) -> LoRARequest | None:
        return self.checked.pop(lora_int_id, None)


def adapter_names(seqs: Iterable) -> tuple[str, ...]:
    """The distinct adapters of these sequences, by name, in first-seen order."""
    names = (s.lora_request.lora_name for s in seqs if s.lora_request is not None)
    return tuple(dict.fromkeys(names))


def lora_stats(scheduler, max_loras: int) -> dict:
    """``EngineStats``' LoRA fields (none while LoRA is off: ``max_loras`` 0)."""
    if not max_loras:
        return {}
    return {"running_lora_adapters": adapter_names(scheduler.running),
            "waiting_lora_adapters": adapter_names(scheduler.waiting),
            "max_lora": max_loras}  # fmt: skip
