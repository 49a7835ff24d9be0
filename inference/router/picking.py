"""Which engine gets a request: pure functions of the request's prefix key and the loads.

Prefix affinity is consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam,
"Consistent Hashing with Bounded Loads", 2017): a key walks the hash ring from its point and
takes the first engine whose load (requests in flight: ``Backend.requests``) is under
``ceil(balance * (total + 1) / n)``.
A conversation's turns share their key, so they reach the engine that holds their prefix in
its KV cache, unless that engine already carries more than its share; then the walk moves on
to the next engine on the ring, the same one for every turn, and removing or adding an
engine moves only the keys next to it.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

VIRTUAL_NODES = 160  # points per engine on the ring: shares within a few percent of even


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True)
class Ring:
    """The hash ring of a set of engines (identified by URL)."""

    points: tuple[int, ...]
    owners: tuple[str, ...]

    @classmethod
    def of(cls, engines: Sequence[str], virtual_nodes: int = VIRTUAL_NODES) -> Ring:
        pairs = sorted((_point(f"{url}#{i}"), url) for url in engines for i in range(virtual_nodes))
        return cls(tuple(p for p, _ in pairs), tuple(u for _, u in pairs))

    def walk(self, key: str) -> list[str]:
        """Every engine once, in ring order from the key's point."""
        if not self.points:
            return []
        start = bisect.bisect(self.points, _point(key))
        seen: dict[str, None] = {}
        count = len(set(self.owners))
        for offset in range(len(self.owners)):
            seen.setdefault(self.owners[(start + offset) % len(self.owners)])
            if len(seen) == count:
                break
        return list(seen)


def bounded_capacity(total_in_flight: int, engines: int, balance: float) -> int:
    """The most requests in flight one engine may carry before keys pass it by."""
    return max(1, math.ceil(balance * (total_in_flight + 1) / max(engines, 1)))


def affinity_order(key: str, ring: Ring, in_flight: dict[str, int], balance: float) -> list[str]:
    """Engines in the order to try for ``key``: the first on the ring under its bounded
    capacity, then the rest of the ring (for retries)."""
    order = [url for url in ring.walk(key) if url in in_flight]
    capacity = bounded_capacity(sum(in_flight.values()), len(order), balance)
    first = next((url for url in order if in_flight[url] < capacity), None)
    if first is None:
        return order
    return [first] + [url for url in order if url != first]


@dataclass(frozen=True)
class EngineLoad:
    """One engine's load: the router's own count of requests in flight to it, and what the
    engine's ``/metrics`` said at the last scrape (vLLM names)."""

    in_flight: int = 0
    waiting: float = 0.0  # vllm:num_requests_waiting
    running: float = 0.0  # vllm:num_requests_running
    kv_cache_usage: float = 0.0  # vllm:kv_cache_usage_perc, 0..1

    def score(self) -> tuple[float, float]:
        # The queue first (what a new request waits behind), then the KV cache (how soon it
        # would preempt). The router's own count is fresher than any scrape; the scrape
        # adds what other routers and clients send.
        return (self.in_flight + self.waiting + self.running / 64.0, self.kv_cache_usage)


def least_load_order(loads: dict[str, EngineLoad]) -> list[str]:
    return sorted(loads, key=lambda url: (loads[url].score(), url))


def prefix_key(body: dict[str, Any], prefix_chars: int) -> str | None:
    """What a conversation's turns have in common: for chat, the messages up to and with the
    first user message (the system prompt and the opening question); for a completion, the
    prompt's first ``prefix_chars`` characters. None when the request has neither."""
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        opening = []
        for message in messages:
            opening.append(message)
            if isinstance(message, dict) and message.get("role") == "user":
                break
        text = json.dumps(opening, sort_keys=True, ensure_ascii=False)
        return text[:prefix_chars] if prefix_chars > 0 else text
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt[:prefix_chars]
    if isinstance(prompt, list) and prompt:  # token ids
        return json.dumps(prompt[: max(prefix_chars // 4, 1)])
    return None
