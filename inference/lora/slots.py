"""Which adapter sits in which device slot: ``max_loras`` slots, least recently used first
out. Pure Python (no torch): decided where a step's inputs are built (``build_step_inputs``),
so one process decides and every tensor-parallel worker applies the same loads.

The scheduler admits at most ``max_loras`` distinct adapters among the running sequences,
so a step never needs more slots than there are; an adapter the step does not use may be
evicted to make room. Overwriting a slot that the step still in flight reads is safe: the
copy into it is queued on the same device stream, after that step's kernels."""

from __future__ import annotations

from collections import OrderedDict

from inference.lora.request import LoRARequest

NO_SLOT = -1  # a row of the base model


class LoRASlotTable:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.slot_of: OrderedDict[LoRARequest, int] = OrderedDict()  # least recent first

    def assign(
        self, requests: list[LoRARequest | None]
    ) -> tuple[list[int], list[tuple[int, LoRARequest]]]:
        """Each row's slot (``NO_SLOT`` for the base model) and the (slot, adapter) loads
        the device must do before the step. ValueError if the step names more adapters
        than there are slots (the scheduler never builds such a step)."""
        wanted = list(dict.fromkeys(r for r in requests if r is not None))
        if len(wanted) > self.max_loras:
            raise ValueError(f"a step uses {len(wanted)} LoRA adapters; max_loras is "
                             f"{self.max_loras}")
        loads = []
        for request in wanted:
            if request in self.slot_of:
                self.slot_of.move_to_end(request)
                continue
            slot = self._free_slot(set(wanted))
            self.slot_of[request] = slot
            loads.append((slot, request))
        return [NO_SLOT if r is None else self.slot_of[r] for r in requests], loads

    def _free_slot(self, in_use: set[LoRARequest]) -> int:
        taken = set(self.slot_of.values())
        for slot in range(self.max_loras):
            if slot not in taken:
                return slot
        victim = next(r for r in self.slot_of if r not in in_use)
        return self.slot_of.pop(victim)

    def forget(self, request: LoRARequest) -> None:
        """An adapter was unloaded: its slot is free (its tensors are overwritten later)."""
        self.slot_of.pop(request, None)
