"""One sequence's state: its tokens, how many of them the KV cache holds, its blocks.

The scheduler thinks in ``num_computed_tokens`` versus ``num_tokens`` (vLLM V1): a fresh
prompt, a prefill chunk, a decode step and a resumption after preemption are all "compute
the tokens the cache does not hold yet". A request with ``n > 1`` owns ``n`` sequences.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from inference.lora.request import LoRARequest
from inference.outputs import Logprob
from inference.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n completions
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    generator: torch.Generator | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)

    token_ids: list[int] = field(init=False)
    status: SequenceStatus = field(init=False, default=SequenceStatus.WAITING)
    num_computed_tokens: int = field(init=False, default=0)
    num_cached_tokens: int = field(init=False, default=0)  # prompt tokens served by the prefix cache
    block_table: list[int] = field(init=False, default_factory=list)
    # Digest of each full block of token_ids (chained), for prefix caching; grows as blocks fill.
    block_hashes: list[bytes] = field(init=False, default_factory=list)
    num_published_blocks: int = field(init=False, default=0)  # full blocks offered to the cache
    finish_reason: str | None = field(init=False, default=None)
    stop_reason: int | str | None = field(init=False, default=None)
    logprobs: list[dict[int, Logprob]] = field(init=False, default_factory=list)
    # Prompt logprobs (params.prompt_logprobs, first of a request's n sequences only): None
    # for the first prompt token, then one dict per prompt token as its chunk completes.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = field(init=False, default=None)
    # Prompt positions whose logprobs have been asked of the runner (a recompute after
    # preemption does not ask again).
    num_prompt_logprob_positions: int = field(init=False, default=0)
    cumulative_logprob: float = field(init=False, default=0.0)
    num_preemptions: int = field(init=False, default=0)
    # Placeholders at the end of token_ids for tokens sampled on the device but not yet read
    # back (async scheduling); the model runner substitutes their values on the device.
    num_pending_tokens: int = field(init=False, default=0)
    # Speculative decoding: tokens proposed to follow token_ids, for this step's query to
    # verify. Never part of token_ids (nor hashed, nor output) until the target accepts
    # them; set before a step is scheduled, cleared when it is launched.
    draft_token_ids: list[int] = field(init=False, default_factory=list)
    # Structured outputs: the grammar matcher (llguidance), advanced with every known token.
    grammar: Any = field(init=False, default=None, repr=False)
    first_scheduled_time: float | None = field(init=False, default=None)
    first_token_time: float | None = field(init=False, default=None)
    last_token_time: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None and self.index == 0:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values the host knows (all but the pending placeholders)."""
        return len(self.token_ids) - self.num_pending_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens : self.num_known_tokens]

    @property
    def num_output_tokens(self) -> int:
        return self.num_known_tokens - self.num_prompt_tokens

    @property
    def reached_max_tokens(self) -> bool:
        """Its last token, pending or known, is the last it may have: nothing to compute."""
        return len(self.token_ids) >= self.num_prompt_tokens + self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_placeholder(self, code: int) -> None:
        self.token_ids.append(code)
        self.num_pending_tokens += 1

    def resolve_placeholder(self, position: int, token_id: int) -> None:
        self.token_ids[position] = token_id
        self.num_pending_tokens -= 1

    def drop_placeholders(self) -> None:
        if self.num_pending_tokens:
            del self.token_ids[-self.num_pending_tokens :]
            self.num_pending_tokens = 0

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: the KV cache forgets everything; tokens stay."""
        self.num_computed_tokens = 0
        self.num_published_blocks = 0
        self.draft_token_ids = []
        self.block_table = []
        self.num_preemptions += 1
        self.status = SequenceStatus.WAITING
