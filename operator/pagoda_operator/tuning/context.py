"""One window as the rules see it: the metrics, the settings, the user's limits, the state
kept so far and what follows from them, in one value instead of seven arguments."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda_operator.tuning.model import (
    GPU_MEMORY_UTILIZATION,
    MAX_NUM_SEQS,
    REPLICAS,
    Limits,
    PolicyConfig,
    Snapshot,
)
from pagoda_operator.tuning.state import TunerState


@dataclass(frozen=True)
class Context:
    snapshot: Snapshot
    settings: dict[str, float]
    limits: Limits
    # Mutable: the window's decision updates it (a change to watch, a move, a ban).
    state: TunerState
    now: float
    config: PolicyConfig
    # The saturated rate per engine, where one measured still holds (capacity.usable).
    capacity: float | None
    # The KV cache usage one window ahead at this window's pace (signals.projected_kv).
    kv_next: float
    rollout_complete: bool = True

    @property
    def pods(self) -> int:
        """Engines reporting, at least one (for the per-engine shares)."""
        return max(self.snapshot.pods, 1)

    @property
    def seqs(self) -> float:
        return self.settings[MAX_NUM_SEQS]

    @property
    def memory(self) -> float:
        return self.settings[GPU_MEMORY_UTILIZATION]

    @property
    def replicas(self) -> float:
        return self.settings[REPLICAS]
