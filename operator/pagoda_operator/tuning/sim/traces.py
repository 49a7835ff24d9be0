"""Workload traces: an arrival rate over time and the request sizes at each moment."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# Chat-like requests: prompts of 512-1536 tokens, answers of 128-640.
CHAT = ((512, 1536), (128, 640))
# Retrieval-heavy requests after the shift: prompts of 8k-24k tokens, short answers.
LONG_CONTEXT = ((8_192, 24_576), (128, 384))


@dataclass(frozen=True)
class Trace:
    name: str
    duration_s: float
    rate: Callable[[float], float]  # requests per second at time t
    sizes: Callable[[float], tuple[tuple[int, int], tuple[int, int]]]  # (prompt, output) ranges
    description: str

    def arrivals(
        self, start: float, dt: float, rng: np.random.Generator
    ) -> list[tuple[float, int, int]]:
        """Poisson arrivals in [start, start + dt) as (time, prompt tokens, output tokens)."""
        count = rng.poisson(self.rate(start) * dt)
        if count == 0:
            return []
        (prompt_low, prompt_high), (output_low, output_high) = self.sizes(start)
        times = np.sort(start + rng.random(count) * dt)
        prompts = rng.integers(prompt_low, prompt_high + 1, count)
        outputs = rng.integers(output_low, output_high + 1, count)
        return list(zip(times.tolist(), prompts.tolist(), outputs.tolist()))


def _chat(_: float) -> tuple[tuple[int, int], tuple[int, int]]:
    return CHAT


def steady() -> Trace:
    return Trace("steady", 3600, lambda t: 120.0, _chat, "120 req/s of chat for an hour")


def diurnal() -> Trace:
    def rate(t: float) -> float:
        # A day squeezed into two hours: a night trough of 20 req/s, a peak of 220 at noon.
        return 120.0 - 100.0 * math.cos(2 * math.pi * t / 7200)

    return Trace("diurnal", 7200, rate, _chat, "20 -> 220 -> 20 req/s of chat over 2 h")


def burst() -> Trace:
    def rate(t: float) -> float:
        return 240.0 if 1200 <= t < 1800 else 80.0

    return Trace("burst", 3600, rate, _chat, "80 req/s with a 10-minute burst of 240 req/s")


def long_context_shift() -> Trace:
    def sizes(t: float) -> tuple[tuple[int, int], tuple[int, int]]:
        return CHAT if t < 1200 else LONG_CONTEXT

    def rate(t: float) -> float:
        return 100.0 if t < 1200 else 14.0

    return Trace(
        "long-context",
        3600,
        rate,
        sizes,
        "100 req/s of chat, then after 20 min 14 req/s of 8k-24k-token prompts",
    )


TRACES: dict[str, Callable[[], Trace]] = {
    "steady": steady,
    "diurnal": diurnal,
    "burst": burst,
    "long-context": long_context_shift,
}
