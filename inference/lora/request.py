"""``LoRARequest``: which adapter a request runs with (vLLM's ``vllm.lora.request`` shape:
``LoRARequest(lora_name, lora_int_id, lora_path)``), torch-free so every layer can carry it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int  # > 0, unique per adapter (0 stands for the base model in vLLM)
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} has no lora_path")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def cache_key(self) -> bytes:
        """What the prefix cache chains this adapter's blocks from: two adapters (or one
        name reloaded from another folder) never share a block's KV."""
        return f"lora\0{self.lora_int_id}\0{self.lora_name}\0{self.lora_path}".encode()
