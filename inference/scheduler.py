"""Continuous batching under a token budget (vLLM V1 style).

There are no prefill and decode phases: every sequence simply has tokens the KV cache does
not hold yet (``num_tokens - num_computed_tokens``): a whole prompt, the rest of a chunked
prompt, a prompt plus outputs after preemption, or the one token sampled last step. Each
step gives running sequences (oldest first) their share of ``max_num_batched_tokens``,
then admits waiting ones in arrival order while budget, ``max_num_seqs`` and free blocks
allow. When blocks run out, the newest running sequence is preempted: it drops its blocks
and goes back to the front of the queue, to be recomputed later from its tokens.

The scheduler also owns the state a step changes (vLLM V1's ``update_from_output``), in two
phases because of async scheduling, where step n+1 is launched before step n's tokens are
known: ``on_step_launched`` counts the batch's tokens as computed and gives each sampling
row a placeholder for the token it will sample; ``on_step_finished`` puts the sampled ids
in place of the placeholders.

Speculative decoding: a running sequence may carry draft tokens (``draft_token_ids``, set
by the engine before ``schedule``). Its query is then its uncomputed token plus the
drafts: the drafts take token budget and KV slots like any token, and the budget trims
them first. At launch only the real token counts as computed; once the target has
verified the drafts, ``on_draft_accepted`` appends each accepted token and counts the
draft before it as computed. A rejected draft's KV slot lies past ``num_computed_tokens``:
it is never hashed into the prefix cache and the next step writes over it. What a token means for its request (stop conditions, text,
logprobs) is the output processor's; the engine hands the sequences that stopped back to
``finish``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from inference.block_manager import BlockManager
from inference.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Rows whose last token is computed this step: each samples the sequence's next token.
    sample_rows: list[int] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_loras: int = 0,
    ) -> None:
        """``max_loras``: most distinct LoRA adapters among the running sequences (0: the
        engine serves none)."""
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_loras = max_loras
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.reached_max_tokens:
                i += 1  # its final token is still on the device: it is about to finish
                continue
            num_drafts = len(seq.draft_token_ids)
            num_new = min(seq.num_tokens - seq.num_computed_tokens + num_drafts, budget)
            if num_drafts and num_new < 1 + num_drafts:
                del seq.draft_token_ids[max(num_new - 1, 0) :]
            while not self.block_manager.allocate(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1

        # A step that had to preempt admits nobody: the freed blocks go to the survivors.
        # LoRA: a sequence whose adapter would exceed max_loras waits, and the ones behind
        # it may go first (as in vLLM); it keeps its place in the queue.
        adapters = self._running_adapters() if self.max_loras and self.waiting else None
        skipped: list[Sequence] = []
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and not batch.preempted
        ):
            seq = self.waiting[0]
            lora = seq.lora_request
            if adapters is not None and lora is not None and lora not in adapters:
                if len(adapters) >= self.max_loras:
                    skipped.append(self.waiting.popleft())
                    continue
                adapters.add(lora)
            cached = self.block_manager.find_cached_prefix(seq) if not seq.block_table else []
            num_cached_tokens = len(cached) * self.block_manager.block_size
            num_new = min(seq.num_tokens - seq.num_computed_tokens - num_cached_tokens, budget)
            if not self.block_manager.allocate(seq, num_new, cached):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

        batch.sample_rows = [
            row for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
            if seq.num_computed_tokens + n == seq.num_tokens + len(seq.draft_token_ids)
        ]  # fmt: skip
        return batch

    def _running_adapters(self) -> set:
        return {s.lora_request for s in self.running if s.lora_request is not None}

    def on_step_launched(self, batch: ScheduledBatch, now: float) -> list[int]:
        """The batch is on the device: its tokens count as computed (full blocks join the
        prefix cache), and each sampling row's sequence gets its coming token as a
        placeholder (``-1 - i`` for the i-th sampling row, which the model runner resolves
        on the device), so the next step can be scheduled before the host knows its value.
        Returns where each placeholder sits in its sequence's ``token_ids``."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            # Drafts count as computed only once accepted (``on_draft_accepted``).
            seq.num_computed_tokens += n - len(seq.draft_token_ids)
            seq.draft_token_ids = []
            self.block_manager.cache_full_blocks(seq)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        positions = []
        for i, row in enumerate(batch.sample_rows):
            seq = batch.seqs[row]
            positions.append(seq.num_tokens)
            seq.append_placeholder(-1 - i)
        return positions

    def on_step_finished(
        self, seqs: list[Sequence], positions: list[int], token_ids: list[int]
    ) -> None:
        """A launched step's sampled ids are on the host: each replaces its placeholder
        (``seqs`` and ``positions`` in sampling-row order, as ``on_step_launched`` left
        them). Sequences finished meanwhile (aborted, or stopped by the token before) have
        dropped their placeholders and are skipped."""
        for seq, position, token_id in zip(seqs, positions, token_ids):
            if seq.status is SequenceStatus.FINISHED:
                continue
            seq.resolve_placeholder(position, token_id)
            self.block_manager.cache_full_blocks(seq)

    def on_draft_accepted(self, seq: Sequence, token_id: int) -> None:
        """After ``on_step_finished`` put a verified step's first token in place: the
        target's next token ``token_id`` follows an accepted draft, so that draft (the
        token before it, whose KV the step wrote) is computed now (unless the sequence was
        preempted while the step ran: with pipelined drafts the next step is scheduled
        before this one is read)."""
        seq.token_ids.append(token_id)
        if seq.status is SequenceStatus.RUNNING:
            seq.num_computed_tokens += 1
            self.block_manager.cache_full_blocks(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.block_manager.free(seq)
        seq.drop_placeholders()
        seq.status = SequenceStatus.FINISHED
