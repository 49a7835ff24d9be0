"""The engine side of speculative decoding: who drafts this step, and what came of it.

``SpecDecoder.propose`` runs before a step is scheduled and gives eligible running
sequences their drafts (a draft model's are placeholders until ``SpecDecoder.fill``, after
the schedule has reserved their KV slots: the draft model writes its own KV there). A sequence drafts only where the result is exactly what
non-speculative decoding would produce and where drafting is likely to pay:

- decoding (one uncomputed token; every token known, or, for pipelined n-gram drafts
  under async scheduling, only the last one still on the device: the step in flight's
  drafts are then taken as accepted and the proposal guesses one token further);
- no structured output (its grammar matcher advances one token at a time, between steps)
  and no repetition/frequency/presence penalty (they read the output so far, which the
  drafts would change mid-step): such rows are excluded, not approximated;
- room left: drafts plus the target's own token never pass ``max_tokens``;
- the step's batch is at most ``disable_by_batch_size`` sequences;
- its drafts have not kept failing: after ``_MAX_FAILED_STEPS`` verified steps in a row
  that accepted nothing, a sequence stops drafting for ``_BACKOFF_STEPS`` steps (doubling
  while it keeps failing), so free-form text does not pay for k wasted positions a step.
  Pipelined, a failure costs a step too: step n + 1 is proposed and launched while step n
  is in flight (step n - 1's result known), so a failure of step n is read only after
  n + 1 went out on the guess that its drafts held, and the sequence's row in n + 1 is
  voided (two steps for one token). A sequence none of whose drafts has been accepted
  since it started drafting (or since its last back-off) therefore backs off after one
  such verify, from the step after it (n + 2, the first proposed with the failure
  known): one voided step per back-off, not ``_MAX_FAILED_STEPS``. Once a verify accepted
  a draft the sequence is taken to copy, and backs off only after ``_MAX_FAILED_STEPS``
  failures in a row as unpipelined (a copying sequence that misses now and then keeps
  drafting every step). And a sequence that has backed off with nothing accepted since
  does not draft while its drafts are in flight: that step's row is voided if they fail,
  the likely case, drafts and all (it saves the k positions, not the step; a sequence
  that has not backed off yet gets the benefit of the doubt, so copying from the first
  step costs nothing).

``SpecDecoder.split`` turns a verified step's samples (one per position) back into one
first token per sampled sequence (what the rest of the step loop expects) plus the
accepted tokens after it, and counts drafts and acceptances for ``/metrics``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from inference.sampler import SamplerOutput
from inference.sequence import Sequence, SequenceStatus
from inference.spec_decode.config import MODEL_METHODS, SpeculativeConfig
from inference.spec_decode.ngram import NgramProposer, TokenHistory

_MAX_FAILED_STEPS = 3
_BACKOFF_STEPS = 8
_MAX_BACKOFF_STEPS = 256


@dataclass
class _DraftState:
    history: TokenHistory = field(default_factory=TokenHistory)
    failed_steps: int = 0  # verified steps in a row that accepted nothing
    # A verify accepted a draft since the sequence started drafting or last backed off.
    accepted_since_resume: bool = False
    backoff: int = _BACKOFF_STEPS  # above _BACKOFF_STEPS: backed off, none accepted since
    resume_at_step: int = 0


@dataclass
class SpecDecodeCounters:
    """Running totals, as vLLM's ``vllm:spec_decode_*`` counters."""

    num_drafts: int = 0  # sequences x steps that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step produced per sequence: accepted drafts + the target's."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class VerifiedTokens:
    """A verified step's samples, per sampled sequence: ``first`` is the usual one-token
    ``SamplerOutput``; ``extra[i]`` the (token id, logprobs) accepted after row i's first."""

    first: SamplerOutput
    extra: list[list[tuple[int, object]]]


class DraftProposer(Protocol):
    """A proposer that runs a model (``inference.spec_decode.draft_model``, ``eagle``): it
    needs the step's KV slots, so it fills drafts after the schedule reserved them."""

    def propose(self, seqs: list[Sequence]) -> None: ...

    def observe(
        self, seqs: list[Sequence], num_new_tokens: list[int], hidden_states: torch.Tensor
    ) -> None:
        """A step was launched: the target's hidden states of its tokens (EAGLE reads
        them; a draft model reads tokens only)."""
        ...

    def close(self) -> None: ...


class SpecDecoder:
    def __init__(
        self, config: SpeculativeConfig, draft: DraftProposer | None = None,
        pipelined: bool = False,
    ) -> None:
        """``draft``: the model of ``method="draft_model"`` or ``"eagle"`` (None for
        n-gram). ``pipelined`` (n-gram with async scheduling): a sequence whose last token
        is still on the device drafts anyway, from its known tokens and the drafts in
        flight (the engine's tentative extension), guessing one token further."""
        if (config.method in MODEL_METHODS) != (draft is not None):
            raise ValueError(f"speculative method {config.method!r} with draft {draft!r}")
        self.config = config
        self.draft = draft
        self.proposer = None if draft is not None else NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
        self.counters = SpecDecodeCounters(
            accepted_per_position=[0] * config.num_speculative_tokens
        )
        self._states: weakref.WeakKeyDictionary[Sequence, _DraftState] = (
            weakref.WeakKeyDictionary()
        )
        self._step = 0
        self.pipelined = pipelined and draft is None

    def may_draft(self, num_running: int) -> bool:
        """Whether a step of this many running sequences speculates at all (the engine
        then completes a step in flight first: drafts need every token known)."""
        return 0 < num_running <= self.config.disable_by_batch_size

    def propose(self, running: list[Sequence]) -> int:
        """Set ``draft_token_ids`` of every running sequence (empty where it does not
        draft this step). Returns how many sequences got drafts."""
        self._step += 1
        speculate = self.may_draft(len(running))
        num_drafting = 0
        for seq in running:
            seq.draft_token_ids = self._drafts(seq) if speculate else []
            num_drafting += bool(seq.draft_token_ids)
        return num_drafting

    def _drafts(self, seq: Sequence) -> list[int]:
        if not _eligible(seq, self.pipelined):
            return []
        state = self._states.get(seq)
        if state is None:
            state = self._states[seq] = _DraftState()
        if self._step < state.resume_at_step:
            return []
        if self.pipelined and seq.num_pending_tokens > 1 and state.backoff > _BACKOFF_STEPS:
            # Its drafts are in flight, taken as accepted (the tentative extension), and
            # it has backed off with none accepted since: not on that guess.
            return []
        room = seq.num_prompt_tokens + seq.params.max_tokens - seq.num_tokens - 1
        if self.draft is not None:  # placeholders: the draft model fills them (``fill``)
            return [0] * max(0, min(room, self.config.num_speculative_tokens))
        known = seq.num_known_tokens
        tokens = state.history.sync(seq.token_ids, known)
        if seq.num_pending_tokens == 0:
            return self.proposer.propose(tokens, room)
        # The last token is on the device (pending drafts before it are the step in
        # flight's, as if accepted): guess it too, and draft what follows the guess.
        if seq.num_tokens - 1 > known:
            tokens = np.concatenate([tokens, seq.token_ids[known : seq.num_tokens - 1]])
        return self.proposer.propose(tokens, room + 1, lookahead=1)[1:]

    def fill(self, scheduled: list[Sequence]) -> None:
        """After the schedule reserved KV slots for the drafts (and trimmed them to the
        budget): the draft model's guesses in place of the placeholders."""
        if self.draft is not None:
            self.draft.propose(scheduled)

    def observe(
        self, seqs: list[Sequence], num_new_tokens: list[int], hidden_states: torch.Tensor
    ) -> None:
        """A launched step's hidden states, for a proposer that drafts from them (the
        runner hands them out for EAGLE only)."""
        if self.draft is not None:
            self.draft.observe(seqs, num_new_tokens, hidden_states)

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()

    def split(
        self, output: SamplerOutput, seqs: list[Sequence], drafts: list[list[int]],
        void: set[int] | frozenset[int] = frozenset(),
    ) -> VerifiedTokens:
        """Per sampled sequence with drafts d (k of them) and picks t (k + 1): keep t[0..m]
        where m is the first position whose pick differs from its draft (or k). Rows in
        ``void`` (their step ran on a tentative extension that did not hold) are not
        counted."""
        first_ids, first_logprobs, extra = [], [], []
        position = 0
        for row, (seq, row_drafts) in enumerate(zip(seqs, drafts, strict=True)):
            picks = output.token_ids[position : position + len(row_drafts) + 1]
            logprobs = output.logprobs[position : position + len(row_drafts) + 1]
            position += len(row_drafts) + 1
            num_accepted = 0
            while num_accepted < len(row_drafts) and picks[num_accepted] == row_drafts[
                    num_accepted]:
                num_accepted += 1
            first_ids.append(picks[0])
            first_logprobs.append(logprobs[0])
            extra.append(list(zip(picks[1 : num_accepted + 1],
                                  logprobs[1 : num_accepted + 1])))
            if row_drafts and row not in void:
                self._count(num_accepted, len(row_drafts))
                self._track(seq, num_accepted)
        first = SamplerOutput(first_ids, first_logprobs, output.prompt_logprobs)
        return VerifiedTokens(first, extra)

    def _track(self, seq: Sequence, num_accepted: int) -> None:
        """The acceptance tracker: back off a sequence whose drafts keep failing (pipelined,
        one that has not accepted any since it resumed, at its first failure)."""
        state = self._states.get(seq)
        if state is None:
            return
        if num_accepted:
            state.failed_steps, state.backoff = 0, _BACKOFF_STEPS
            state.accepted_since_resume = True
            return
        state.failed_steps += 1
        patient = state.accepted_since_resume or not self.pipelined
        if state.failed_steps >= (_MAX_FAILED_STEPS if patient else 1):
            state.resume_at_step = self._step + state.backoff
            state.backoff = min(2 * state.backoff, _MAX_BACKOFF_STEPS)
            state.failed_steps = 0
            state.accepted_since_resume = False

    def _count(self, num_accepted: int, num_drafts: int) -> None:
        counters = self.counters
        counters.num_drafts += 1
        counters.num_draft_tokens += num_drafts
        counters.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            counters.accepted_per_position[position] += 1


def _eligible(seq: Sequence, pipelined: bool) -> bool:
    p = seq.params
    return (
        seq.status is SequenceStatus.RUNNING
        and (pipelined or seq.num_pending_tokens == 0)
        and seq.num_tokens - seq.num_computed_tokens == 1
        and seq.grammar is None
        and p.repetition_penalty == 1.0 and not p.frequency_penalty and not p.presence_penalty
    )
