"""What the tensor-parallel executor and its workers say to each other, in one place.

The engine's side (``multiproc``) writes each message, pickled once, to every worker's
pipe; each worker (``worker``) answers over the same pipe. Every message is a small frozen
dataclass, so both sides name the same fields and a type checker sees a misspelt one (as
the engine-process protocol in ``inference.engine_messages``).

engine -> worker: the set-up calls ``DetermineNumBlocks``, ``AllocateKvCache`` and
``CaptureGraphs`` (every rank replies), ``ExecuteStep`` (rank 0 replies, once the next step
is queued or on ``Flush``), ``Shutdown``.
worker -> engine: ``Reply`` (a set-up call's or a step's result; first ``WorkerReady``,
once the shard is loaded) or ``WorkerFailed`` (any rank, right before it exits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inference.runner.step_inputs import StepInputs
from inference.sampler import SamplingMetadata
from inference.sampling_params import SamplingParams


@dataclass(frozen=True)
class DetermineNumBlocks:
    """How many KV blocks fit on every rank (the smallest of the ranks' counts)."""


@dataclass(frozen=True)
class AllocateKvCache:
    num_blocks: int


@dataclass(frozen=True)
class CaptureGraphs:
    """CUDA graphs and kernel warm-up; the reply is the seconds spent."""


SetupCall = DetermineNumBlocks | AllocateKvCache | CaptureGraphs


@dataclass(frozen=True)
class NewSequence:
    """A sampled sequence the workers have not seen: its sampling state, kept by the
    workers until it finishes (sent once: pickling params every step would cost
    milliseconds at large batches). ``seed``: the workers seed their own generator
    (``torch.Generator`` objects do not pickle)."""

    params: SamplingParams
    seed: int | None


@dataclass(frozen=True)
class ExecuteStep:
    """One step. ``sampling`` comes without params and generators: the workers look them
    up by ``seq_ids``, the sampled rows' sequence ids."""

    inputs: StepInputs
    sample_rows: list[int]
    sampling: SamplingMetadata
    seq_ids: list[int]
    new_seqs: dict[int, NewSequence]
    finished: list[int]  # sequence ids whose sampling state the workers may drop


@dataclass(frozen=True)
class Flush:
    """Reply for the last step now: the engine waits for it without sending another."""


@dataclass(frozen=True)
class Shutdown:
    pass


WorkerMessage = SetupCall | ExecuteStep | Flush | Shutdown


@dataclass(frozen=True)
class WorkerReady:
    load_seconds: float
    pid: int


@dataclass(frozen=True)
class Reply:
    value: Any


@dataclass(frozen=True)
class WorkerFailed:
    """What went wrong, with the worker's traceback."""

    text: str
