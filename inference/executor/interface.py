"""``ModelExecutor``: what the engine calls to run the model, and nothing more.

Two classes implement it. ``ModelRunner`` (``inference.runner.model_runner``) runs the model
in the engine's own process, on one device; ``MultiprocExecutor`` (``multiproc``) drives
one worker process per GPU under tensor parallelism, each holding a ``ModelRunner`` of its
shard. ``engine_setup.make_runner`` picks one and the engine holds it as a
``ModelExecutor``: it calls only the members named here, so neither side can come to rely
on something the other lacks. Structural typing (a ``Protocol``) rather than a base class:
the runner sits below this package and does not import it.
``tests/engine/test_tensor_parallel.py`` checks that both provide every member.
"""

from __future__ import annotations

from typing import Protocol

import torch

from inference.lora.request import LoRARequest
from inference.sampler import SamplerOutput, SamplingMetadata
from inference.sequence import Sequence


class PendingStep(Protocol):
    """A launched step. ``result()`` waits for its sampled tokens and prompt logprobs
    (None: the step sampled nothing and scored no prompt); the host may do other work
    between launching a step and asking for its result. ``hidden_states``: the target's
    final hidden states of the step's tokens where the executor keeps them (one device,
    EAGLE), valid until the next launch; else None."""

    hidden_states: torch.Tensor | None

    def result(self) -> SamplerOutput | None: ...


class ModelExecutor(Protocol):
    """Start-up (size the KV cache, allocate it, capture graphs), steps, health, shutdown."""

    load_seconds: float  # loading the weights, for the start-up report
    # Whether a launched step's ``result()`` may be called from another thread while this
    # one launches the next step (the engine then reads a constrained step's tokens and
    # fills the next grammar masks on a thread of their own).
    concurrent_results: bool

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one KV block on one device."""
        ...

    @property
    def dead_reason(self) -> str | None:
        """Why no more steps can run (a tensor-parallel worker died or failed), or None."""
        ...

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit (``num_kv_blocks``, or what profiling leaves free)."""
        ...

    def allocate_kv_cache(self, num_blocks: int) -> None: ...

    def capture_graphs(self) -> float:
        """CUDA graphs and kernel warm-up before serving; returns the seconds spent."""
        ...

    def launch(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        sample_rows: list[int],
        sampling: SamplingMetadata,
    ) -> PendingStep:
        """Queue one step: compute ``num_new_tokens[i]`` tokens of ``seqs[i]`` and sample a
        token for each sequence at ``sample_rows``; returns without waiting for it."""
        ...

    def prefetch_lora(self, request: LoRARequest) -> None:
        """A request with this adapter arrived: its tensors may be read ahead of the step."""
        ...

    def forget_lora(self, request: LoRARequest) -> None:
        """An adapter was unloaded: it leaves its device slot (and the CPU cache)."""
        ...

    def close(self) -> None:
        """Release what the executor holds (worker processes); safe to call twice."""
        ...
