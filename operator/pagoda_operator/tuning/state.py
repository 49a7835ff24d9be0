"""What the tuner remembers between windows, typed, and its one form in ``status.tuning.state``.

The status form is camelCase JSON that existing LLMDeployments already hold, so its keys
never change: ``TunerState.from_status`` reads any state an earlier window wrote (keys it
lacks take their defaults) and ``to_status`` writes exactly those keys back. Nothing else
reads or writes the status form.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any

from pagoda_operator.tuning.model import direction


@dataclass
class Streaks:
    """Consecutive windows for which each condition of ``signals.updated_streaks`` held."""

    overload: int = 0
    idle: int = 0
    preempting: int = 0
    kv_bound: int = 0
    kv_busy: int = 0
    calm: int = 0
    near_target: int = 0
    busy: int = 0
    queued: int = 0

    @classmethod
    def from_status(cls, data: dict[str, Any] | None) -> Streaks:
        data = data or {}
        return cls(**{f.name: data.get(_camel(f.name)) or 0 for f in fields(cls)})

    def to_status(self) -> dict[str, int]:
        return {_camel(f.name): getattr(self, f.name) for f in fields(self)}


@dataclass
class Capacity:
    """Requests/s one engine served in the last window it was saturated (``capacity``),
    and what that window showed of why: the ``maxNumSeqs`` it ran, the sequences each
    engine ran, its ITL p95 (a decode step) and its KV cache usage. A state written before
    those were kept lacks them (None), and its rate then holds for any ``maxNumSeqs``."""

    requests_per_pod: float
    prompt_tokens_per_request: float
    time: float
    max_num_seqs: float | None = None
    running_per_pod: float | None = None
    itl_s: float | None = None
    kv_cache_usage: float | None = None

    @classmethod
    def from_status(cls, data: dict[str, Any] | None) -> Capacity | None:
        if not data:
            return None
        return cls(
            data["requestsPerPod"],
            data.get("promptTokensPerRequest") or 0.0,
            data["time"],
            **{name: data.get(key) for name, key in _MEASURED.items()},
        )

    def to_status(self) -> dict[str, Any]:
        data = {
            "requestsPerPod": self.requests_per_pod,
            "promptTokensPerRequest": self.prompt_tokens_per_request,
            "time": self.time,
        }
        # Only where measured: a state written without them round-trips unchanged.
        for name, key in _MEASURED.items():
            if getattr(self, name) is not None:
                data[key] = getattr(self, name)
        return data


_MEASURED = {  # Capacity's fields of the window measured -> their keys in the status
    "max_num_seqs": "maxNumSeqs",
    "running_per_pod": "requestsRunningPerPod",
    "itl_s": "itlP95Seconds",
    "kv_cache_usage": "kvCacheUsage",
}


@dataclass
class Pending:
    """A change applied and under watch until it is judged (see ``judge``)."""

    knob: str
    from_: float
    to: float
    time: float
    baseline: dict[str, Any]  # Snapshot.summary() of the window it is judged against
    # When its rollout completed; None while it rolls out (and absent from the status then:
    # a null in a merge patch removes its key, RFC 7386).
    settled_time: float | None = None
    # A change of replicas that adds engines to cover an engine-knob change's rollout.
    cover: bool = False

    @classmethod
    def from_status(cls, data: dict[str, Any] | None) -> Pending | None:
        if data is None:
            return None
        return cls(
            knob=data["knob"],
            from_=data["from"],
            to=data["to"],
            time=data["time"],
            baseline=dict(data.get("baseline") or {}),
            settled_time=data.get("settledTime"),
            cover=bool(data.get("cover")),
        )

    def to_status(self) -> dict[str, Any]:
        data = {
            "knob": self.knob,
            "from": self.from_,
            "to": self.to,
            "time": self.time,
            "settledTime": self.settled_time,
            "baseline": self.baseline,
        }
        if self.cover:
            data["cover"] = True
        return data


@dataclass
class Cover:
    """An engine-knob change waiting for (``adding``) or rolling out on (``rolling``) the
    engines added to cover its rollout; see ``cover``."""

    phase: str  # "adding" or "rolling"
    knob: str
    from_: float
    to: float
    reason: str
    engines: int
    replicas: float  # the replicas with the engines added
    baseline: dict[str, Any]  # the window before the engines came

    @classmethod
    def from_status(cls, data: dict[str, Any] | None) -> Cover | None:
        if data is None:
            return None
        names = {f.name: data[_camel(f.name)] for f in fields(cls) if f.name != "baseline"}
        return cls(**names, baseline=dict(data.get("baseline") or {}))

    def to_status(self) -> dict[str, Any]:
        return {_camel(f.name): getattr(self, f.name) for f in fields(self)}


@dataclass
class Move:
    """The last move of one knob, for the reversal dwell."""

    direction: int
    time: float


@dataclass
class Ban:
    """A reverted value, not tried again (nor anything past it that way) until ``until``."""

    knob: str
    value: float
    direction: int
    until: float


@dataclass
class TunerState:
    streaks: Streaks = field(default_factory=Streaks)
    capacity: Capacity | None = None
    pending: Pending | None = None
    cover: Cover | None = None
    last_change_time: float | None = None
    last_move: dict[str, Move] = field(default_factory=dict)
    rejected: list[Ban] = field(default_factory=list)
    last_oom_time: float | None = None
    last_kv_usage: float | None = None

    @classmethod
    def from_status(cls, data: dict[str, Any] | None) -> TunerState:
        """The state as ``status.tuning.state`` holds it (None: a first window)."""
        data = copy.deepcopy(data or {})
        return cls(
            streaks=Streaks.from_status(data.get("streaks")),
            capacity=Capacity.from_status(data.get("capacity")),
            pending=Pending.from_status(data.get("pending")),
            cover=Cover.from_status(data.get("cover")),
            last_change_time=data.get("lastChangeTime"),
            last_move={
                knob: Move(move["direction"], move["time"])
                for knob, move in (data.get("lastMove") or {}).items()
            },
            rejected=[
                Ban(ban["knob"], ban["value"], ban["direction"], ban["until"])
                for ban in data.get("rejected") or []
            ],
            last_oom_time=data.get("lastOomTime"),
            last_kv_usage=data.get("lastKvUsage"),
        )

    def to_status(self) -> dict[str, Any]:
        """The state for ``status.tuning.state``; every key, None where unset."""
        return copy.deepcopy({
            "streaks": self.streaks.to_status(),
            "capacity": None if self.capacity is None else self.capacity.to_status(),
            "pending": None if self.pending is None else self.pending.to_status(),
            "cover": None if self.cover is None else self.cover.to_status(),
            "lastChangeTime": self.last_change_time,
            "lastMove": {
                knob: {"direction": move.direction, "time": move.time}
                for knob, move in self.last_move.items()
            },
            "rejected": [
                {"knob": ban.knob, "value": ban.value, "direction": ban.direction,
                 "until": ban.until}
                for ban in self.rejected
            ],
            "lastOomTime": self.last_oom_time,
            "lastKvUsage": self.last_kv_usage,
        })  # fmt: skip

    def record_move(self, knob: str, old: float, new: float, now: float) -> None:
        self.last_change_time = now
        self.last_move[knob] = Move(direction(old, new), now)


def _camel(name: str) -> str:
    """``kv_bound`` -> ``kvBound``; ``from_`` -> ``from`` (a Python keyword)."""
    head, *rest = name.rstrip("_").split("_")
    return head + "".join(part.capitalize() for part in rest)
