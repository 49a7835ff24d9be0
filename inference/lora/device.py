"""The adapters on the device: per layer and projection, every slot's A and B in one
preallocated tensor, the step's per-token slot index, and a CPU cache of loaded adapters.

Layout (``kernels.lora``): a projection of ``S`` parts (qkv: 3, gate_up: 2, o and down: 1)
holds ``A [max_loras, S * max_rank, in]`` and ``B [max_loras, out, S * max_rank]``; part
``i``'s A fills rank rows ``i * max_rank ...`` and its B those rank columns in the part's
own output rows, zero elsewhere, so an adapter of a lower rank, or one that leaves a part
out, adds exactly its own update. Tensor parallelism shards as the base weights do
(``LlamaForCausalLM._shard_table``): column-parallel parts (q/k/v, gate/up) take their rows
of B and all of A; row-parallel ones (o, down) their columns of A and all of B, so the
partial updates sum in the layer's all-reduce like the base projection's.

Nothing is allocated per step: ``token_slots`` is filled in place (``stage``), so a CUDA
graph captured over these tensors replays with each step's adapters.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

import pagoda_kernels as kernels
from inference.lora.peft import PeftAdapter, load_adapter
from inference.lora.request import LoRARequest
from inference.models.config import ModelConfig

# Fused projection -> its parts, in the order their rows are stacked.
FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
ROW_PARALLEL = ("o_proj", "down_proj")


class LayerLoRA:
    """One decoder layer's view: ``add(projection, x, y)`` adds each row's update to y."""

    def __init__(self, device_loras: DeviceLoRAs, index: int) -> None:
        self.device_loras = device_loras
        self.index = index

    def add(self, projection: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        owner = self.device_loras
        if not owner.active:
            return y
        a, b = owner.stacks[self.index][projection]
        return kernels.add_lora(y, x, a, b, owner.token_slots[: x.shape[0]])


class DeviceLoRAs:
    def __init__(
        self, model: torch.nn.Module, cfg: ModelConfig, max_loras: int, max_rank: int,
        max_cpu_loras: int, max_tokens: int, dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        self.model, self.cfg = model, cfg
        self.max_rank, self.max_cpu_loras = max_rank, max_cpu_loras
        self.dtype, self.device = dtype, device
        self.stacks: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for layer in model.layers:
            sizes = _local_shapes(layer, cfg)
            self.stacks.append({
                name: (
                    torch.zeros(max_loras, len(parts) * max_rank, sizes[name][1],
                                dtype=dtype, device=device),
                    torch.zeros(max_loras, sizes[name][0], len(parts) * max_rank,
                                dtype=dtype, device=device),
                )
                for name, parts in FUSED_PARTS.items()
            })  # fmt: skip
        self.max_tokens = max_tokens  # the largest step the slot buffers hold
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        # Eager steps without any adapter row skip the LoRA ops; graph capture sets it.
        self.active = False
        # Pinned staging of the slot indices, two buffers used in turn (as the step
        # graphs' inputs): the host may fill one while the other's copy is queued.
        on_gpu = device.type == "cuda"
        self._host = [torch.empty(max_tokens, dtype=torch.int32, pin_memory=on_gpu)
                      for _ in range(2)]  # fmt: skip
        self._staged = [torch.cuda.Event() if on_gpu else None for _ in range(2)]
        self._num_staged = 0
        self.cpu_cache: OrderedDict[LoRARequest, PeftAdapter] = OrderedDict()
        # Adapters being read from their folders off the step loop (``prefetch``).
        self._reading: dict[LoRARequest, Future] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="lora-read")
        for index, layer in enumerate(model.layers):
            layer.lora = LayerLoRA(self, index)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.stacks
                   for pair in layer.values() for t in pair)  # fmt: skip

    # -- adapters into slots -------------------------------------------------------------
    def prefetch(self, request: LoRARequest) -> None:
        """Start reading an adapter's tensors in a thread of their own (a request with it
        has arrived), so that the step that first needs them does not read the folder."""
        if request not in self.cpu_cache and request not in self._reading:
            self._reading[request] = self._reader.submit(
                load_adapter, request.lora_path, self.cfg, self.max_rank)

    def cpu_adapter(self, request: LoRARequest) -> PeftAdapter:
        """The adapter's tensors, from the CPU cache (``max_cpu_loras``, LRU), the read
        under way, or its folder."""
        adapter = self.cpu_cache.get(request)
        if adapter is None:
            reading = self._reading.pop(request, None)
            adapter = reading.result() if reading is not None else load_adapter(
                request.lora_path, self.cfg, self.max_rank)  # fmt: skip
            self.cpu_cache[request] = adapter
            while len(self.cpu_cache) > self.max_cpu_loras:
                self.cpu_cache.popitem(last=False)
        else:
            self.cpu_cache.move_to_end(request)
        return adapter

    @torch.inference_mode()
    def load(self, slot: int, request: LoRARequest) -> None:
        adapter = self.cpu_adapter(request)
        shards = self.model._shard_table()
        r, big_r = adapter.info.rank, self.max_rank
        for index, stacks in enumerate(self.stacks):
            for name, parts in FUSED_PARTS.items():
                a_stack, b_stack = stacks[name]
                a_slot, b_slot = a_stack[slot], b_stack[slot]
                a_slot.zero_()
                b_slot.zero_()
                for i, part in enumerate(parts):
                    pair = adapter.weights.get((index, part))
                    if pair is None:
                        continue
                    a, b = pair
                    rows, (dim, start, length) = shards[part]
                    if dim is not None and part in ROW_PARALLEL:
                        a = a.narrow(1, start, length)
                    elif dim is not None:
                        b = b.narrow(0, start, length)
                    out_rows = b_slot if rows is None else b_slot.narrow(0, *rows)
                    a_slot[i * big_r : i * big_r + r].copy_(a)
                    out_rows[:, i * big_r : i * big_r + r].copy_(b)

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)
        self._reading.clear()
        self.cpu_cache.clear()

    def forget(self, request: LoRARequest) -> None:
        self.cpu_cache.pop(request, None)
        self._reading.pop(request, None)

    # -- a step ---------------------------------------------------------------------------
    def stage(self, token_slots: np.ndarray | None, loads: list[tuple[int, LoRARequest]]) -> None:
        """Before a step: load new adapters into their slots, then write each token's slot
        (the rest of the buffer -1, so padding rows of a replayed graph add nothing)."""
        for slot, request in loads:
            self.load(slot, request)
        if token_slots is None or not (token_slots >= 0).any():
            if self.active:  # a replayed graph reads the buffer: no stale slots in it
                self.token_slots.fill_(-1)
            self.active = False
            return
        self.active = True
        n = len(token_slots)
        which = self._num_staged % 2
        self._num_staged += 1
        event = self._staged[which]
        if event is not None:
            event.synchronize()  # at once unless the device is two steps behind
        host = self._host[which]
        host.numpy()[:n] = token_slots
        self.token_slots[n:].fill_(-1)
        self.token_slots[:n].copy_(host[:n], non_blocking=True)
        if event is not None:
            event.record()

    def capturing(self) -> None:
        """Graphs record the LoRA ops whatever the step (no adapter rows: they add zero)."""
        self.token_slots.fill_(-1)
        self.active = True


def _local_shapes(layer: torch.nn.Module, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each fused projection on this rank."""
    qkv_out = layer.q_size + 2 * layer.kv_size
    world = layer.parallel.world_size
    intermediate = cfg.intermediate_size // world
    return {"qkv_proj": (qkv_out, cfg.hidden_size), "o_proj": (cfg.hidden_size, layer.q_size),
            "gate_up_proj": (2 * intermediate, cfg.hidden_size),
            "down_proj": (cfg.hidden_size, intermediate)}  # fmt: skip
