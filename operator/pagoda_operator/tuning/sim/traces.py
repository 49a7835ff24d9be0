"""Workload traces: an arrival rate over time, the request sizes at each moment, and the
shared prompt prefixes (tenants' system prompts) requests start with.

Every trace serves the Qwen2.5-7B shape: on an H200 its KV cache holds ~2M tokens (a
1.5B's holds 4.6M), so long prompts and long conversations fill it and the engine knobs
(``maxNumSeqs``, ``gpuMemoryUtilization``) decide how much one GPU serves.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Sizes = tuple[tuple[int, int], tuple[int, int]]  # (prompt range, output range) in tokens

# Chat-like requests: prompts of 512-1536 tokens, answers of 128-640.
CHAT: Sizes = ((512, 1536), (128, 640))
# Retrieval-heavy requests: prompts of 8k-24k tokens, short answers.
LONG_CONTEXT: Sizes = ((8_192, 24_576), (128, 384))


@dataclass(frozen=True)
class Tenants:
    """``count`` tenants, each with its own system prompt of ``prefix_len`` tokens that
    every one of its requests starts with (the rest of the prompt is the request's own)."""

    count: int
    prefix_len: int


@dataclass(frozen=True)
class Trace:
    name: str
    duration_s: float
    rate: Callable[[float], float]  # requests per second at time t
    sizes: Callable[[float], Sizes]
    description: str
    model: str = "qwen2.5-7b"
    ttft_target_s: float = 1.0
    tenants: Tenants | None = None
    # (share, sizes): each request independently takes these sizes with that probability.
    mix: Callable[[float], tuple[float, Sizes]] | None = None

    def arrivals(
        self, start: float, dt: float, rng: np.random.Generator
    ) -> list[tuple[float, int, int, int, int]]:
        """Poisson arrivals in [start, start + dt) as (time, prompt tokens, output tokens,
        prefix, prefix tokens); the prompt includes the prefix."""
        count = rng.poisson(self.rate(start) * dt)
        if count == 0:
            return []
        times = np.sort(start + rng.random(count) * dt)
        prompts, outputs = _draw(self.sizes(start), count, rng)
        if self.mix is not None:
            share, sizes = self.mix(start)
            other = rng.random(count) < share
            mixed_prompts, mixed_outputs = _draw(sizes, count, rng)
            prompts = np.where(other, mixed_prompts, prompts)
            outputs = np.where(other, mixed_outputs, outputs)
        if self.tenants is None:
            prefixes, prefix_len = np.full(count, -1), 0
        else:
            prefixes, prefix_len = rng.integers(0, self.tenants.count, count), self.tenants.prefix_len
        return [(t, int(p) + prefix_len, int(o), int(f), prefix_len if f >= 0 else 0)
                for t, p, o, f in zip(times.tolist(), prompts, outputs, prefixes)]


def _draw(sizes: Sizes, count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    (prompt_low, prompt_high), (output_low, output_high) = sizes
    return (rng.integers(prompt_low, prompt_high + 1, count),
            rng.integers(output_low, output_high + 1, count))  # fmt: skip


def _chat(_: float) -> Sizes:
    return CHAT


def diurnal() -> Trace:
    def rate(t: float) -> float:
        # A day squeezed into two hours: a night trough of 10 req/s, a peak of 130 at noon.
        return 70.0 - 60.0 * math.cos(2 * math.pi * t / 7200)

    return Trace("diurnal", 7200, rate, _chat, "10 -> 130 -> 10 req/s of chat over 2 h")


def burst() -> Trace:
    def rate(t: float) -> float:
        return 120.0 if 1200 <= t < 1800 else 40.0

    return Trace("burst", 3600, rate, _chat, "40 req/s of chat with a 10-minute burst of 120 req/s")


def long_context_shift() -> Trace:
    def sizes(t: float) -> Sizes:
        return CHAT if t < 1200 else LONG_CONTEXT

    def rate(t: float) -> float:
        return 48.0 if t < 1200 else 5.0

    return Trace(
        "long-context", 3600, rate, sizes,
        "48 req/s of chat, then after 20 min 5 req/s of 8k-24k-token prompts",
        ttft_target_s=3.0,
    )  # fmt: skip


def kv_growth() -> Trace:
    """Answers that grow (reasoning turned on, agents taking more steps): the same request
    rate and prompts, outputs from 256-1024 tokens to 2k-6k over 40 minutes. Sequences live
    longer and hold more KV each, until the batch that ``maxNumSeqs`` allows no longer fits
    the cache."""

    def sizes(t: float) -> Sizes:
        grown = min(1.0, t / 2400)
        return (4_096, 8_192), (int(256 + 1_792 * grown), int(1_024 + 5_120 * grown))

    return Trace(
        "kv-growth", 3600, lambda t: 4.0, sizes,
        "4 req/s of 4k-8k-token prompts whose answers grow from 256-1k to 2k-6k tokens "
        "over 40 min",
        ttft_target_s=3.0,
    )  # fmt: skip


def tenants() -> Trace:
    return Trace(
        "tenants", 3600, lambda t: 120.0, lambda t: ((64, 512), (64, 256)),
        "120 req/s from 16 tenants, each request a 3k-token tenant system prompt and "
        "64-512 tokens of its own",
        tenants=Tenants(16, 3_072),
    )  # fmt: skip


TRACES: dict[str, Callable[[], Trace]] = {
    "kv-growth": kv_growth,
    "long-context": long_context_shift,
    "burst": burst,
    "diurnal": diurnal,
    "tenants": tenants,
}
