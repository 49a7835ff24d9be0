"""The draft-model proposer: a smaller model sharing the target's tokenizer guesses the next
``k`` tokens greedily, one forward pass per token, before the target verifies them.

Its KV cache mirrors the target's: the same number of blocks, indexed by the target's
block tables. A block the block manager gives a sequence holds both models' KV for the
same positions, so the block manager's rules (allocation, preemption, aborts, the prefix
cache) govern the draft's cache with no second manager. What differs is how far each is
computed: the draft runs only when a sequence drafts, so it may lag the target. Each
sequence remembers how many of its leading positions hold the draft's KV
(``_DraftKV.num_tokens``); the first forward of a drafting round catches up from there.

- A new sequence starts at 0 even when the target's prefix cache served its prompt: a
  cached block may hold the target's KV without the draft's (it was filled while the draft
  lagged), so the draft recomputes the prompt once (writing the same values where another
  sequence's draft already did).
- A preemption (``Sequence.num_preemptions`` moved) frees the blocks: back to 0.
- After verification only the positions the target computed hold real tokens: a draft
  position past the accepted ones held a rejected guess, and the next round writes over
  it (``min`` with ``num_computed_tokens``).

Drafts are the draft model's argmax. The target's rejection sampler treats any proposal
as a point mass (``inference.spec_decode.rejection``), which keeps the target's
distribution exactly whatever the draft proposes; greedy drafts are simply the ones a
point-mass rule accepts most often.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inference.config import ResolvedEngineConfig
from inference.model_files import load_tokenizer, resolve_model
from inference.model_shapes import resolve_shape_model
from inference.models.config import ModelConfig
from inference.quantization import resolve_quantization
from inference.runner.model_runner import ModelRunner
from inference.runner.step_inputs import StepInputs
from inference.sequence import Sequence
from inference.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _DraftKV:
    num_tokens: int = 0  # leading positions whose draft KV is valid
    num_preemptions: int = 0  # the sequence's count when num_tokens was last valid


def draft_engine_config(
    target: ResolvedEngineConfig, target_model: ModelConfig, spec: SpeculativeConfig,
    target_tokenizer: Any = None,
) -> tuple[ResolvedEngineConfig, ModelConfig, str]:
    """The draft's config (the target's, with the draft's folder, quantization and load
    format), its model config and folder. ``spec.model`` is a folder or a named shape
    (random weights, for benchmarks). ValueError where the draft cannot serve the target."""
    folder, extra = resolve_shape_model(spec.model)
    try:
        path = resolve_model(folder)
        model_config = ModelConfig.from_folder(path)
    except (ValueError, OSError) as exc:
        raise ValueError(f"speculative_config draft model {spec.model!r}: {exc}") from None
    check_shared_tokenizer(spec.model, model_config, path, target_model, target_tokenizer)
    limit = model_config.max_position_embeddings
    if limit < target.max_model_len:
        raise ValueError(
            f"speculative_config draft model {spec.model!r} attends to {limit} tokens, fewer "
            f"than max_model_len={target.max_model_len}")
    config = dataclasses.replace(
        target, model=str(path), tokenizer=None, speculative_config=None,
        load_format=extra.get("load_format", target.load_format),
        quantization=resolve_quantization(None, model_config.quantization_config),
    )  # fmt: skip
    return config, model_config, str(path)


def check_shared_tokenizer(
    name: str, draft: ModelConfig, draft_path: Path, target: ModelConfig, target_tokenizer: Any
) -> None:
    """A draft proposes the target's token ids, so both must read ids the same way. Equal
    embedding tables pass; tables of different sizes (a family pads them differently:
    Qwen2.5-0.5B has 151,936 rows, Qwen2.5-7B 152,064) pass when both folders hold the same
    tokenizer, the rows past it being padding no model emits."""
    if draft.vocab_size == target.vocab_size:
        return
    mismatch = (f"speculative_config draft model {name!r} has a vocabulary of "
                f"{draft.vocab_size} tokens, the target {target.vocab_size}")
    draft_tokenizer = load_tokenizer(draft_path)
    if draft_tokenizer is None or target_tokenizer is None:
        raise ValueError(f"{mismatch}, and no tokenizer files show they share one: a draft "
                         "model must share the target's tokenizer")
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"{mismatch}, and its tokenizer differs from the target's: a draft "
                         "model must share the target's tokenizer")


class DraftModelProposer:
    """Loads the draft model in this process; ``propose`` fills scheduled sequences'
    drafts (their count already set by the scheduler, their values placeholders)."""

    def __init__(
        self, target: ResolvedEngineConfig, target_model: ModelConfig, spec: SpeculativeConfig,
        target_tokenizer: Any = None,
    ) -> None:
        config, model_config, path = draft_engine_config(
            target, target_model, spec, target_tokenizer)
        self.runner = ModelRunner(config, model_config, path)
        # Ids both models embed: a draft's padding rows past the target's table are never
        # proposed.
        self.num_proposable = min(model_config.vocab_size, target_model.vocab_size)
        self.block_size = config.block_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self._kv: weakref.WeakKeyDictionary[Sequence, _DraftKV] = weakref.WeakKeyDictionary()

    @property
    def bytes_per_block(self) -> int:
        return self.runner.bytes_per_block

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """As many blocks as the target's: the target's block ids index both caches."""
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.capture_graphs()

    def close(self) -> None:
        self.runner.close()

    def observe(
        self, seqs: list[Sequence], num_new_tokens: list[int], hidden_states: torch.Tensor
    ) -> None:
        """The target's hidden states: a draft model reads tokens only (never called: the
        runner hands hidden states out for EAGLE)."""

    def propose(self, seqs: list[Sequence]) -> None:
        """Overwrite each sequence's ``draft_token_ids`` (all known tokens; its KV slots
        allocated for them by this step's schedule) with the draft model's greedy guesses.

        The guesses stay on the device between the draft's forwards: a forward reads the
        previous one's picks as placeholders (``-1 - i`` stands for ``sampled_ids[i]``,
        resolved inside the captured graph), so the host queues every forward of the
        round without waiting and reads all guesses back once, at the end."""
        seqs = [s for s in seqs if s.draft_token_ids]
        if not seqs:
            return
        starts = [self._valid_prefix(seq) for seq in seqs]
        picks = self._catch_up(seqs, starts)
        rounds = [(seqs, picks)]
        rows = seqs
        sampled_ids = self.runner.sampled_ids
        for j in range(1, max(len(s.draft_token_ids) for s in seqs)):
            keep = [i for i, s in enumerate(rows) if len(s.draft_token_ids) > j]
            sampled_ids[: len(rows)].copy_(picks)
            rows = [rows[i] for i in keep]
            positions = [s.num_tokens - 1 + j for s in rows]
            picks = self._forward(rows, [[-1 - i] for i in keep], positions, sample=rows)
            rounds.append((rows, picks))
        values = torch.cat([p for _, p in rounds]).tolist()  # the round's one wait
        at = 0
        for j, (rows, _) in enumerate(rounds):
            for seq, token in zip(rows, values[at : at + len(rows)]):
                seq.draft_token_ids[j] = token
            at += len(rows)
        for seq in seqs:  # positions up to the last draft's are written, not that one
            self._kv[seq].num_tokens = seq.num_tokens - 1 + len(seq.draft_token_ids)

    def _valid_prefix(self, seq: Sequence) -> int:
        state = self._kv.get(seq)
        if state is None or state.num_preemptions != seq.num_preemptions:
            state = self._kv[seq] = _DraftKV(0, seq.num_preemptions)
        # Past num_computed_tokens lie rejected guesses (or nothing yet).
        state.num_tokens = min(state.num_tokens, seq.num_computed_tokens)
        return state.num_tokens

    def _catch_up(self, seqs: list[Sequence], starts: list[int]) -> torch.Tensor:
        """Run the tokens from each sequence's valid prefix to its last token through the
        draft (in chunks of the step budget); returns the first draft of each, on the
        device. A chunk takes the sequences in order, so they finish (and are sampled) in
        order."""
        parts: list[torch.Tensor] = []
        done = list(starts)
        while done[-1] < seqs[-1].num_tokens:
            budget = self.max_num_batched_tokens
            rows, chunks, positions, sample = [], [], [], []
            for i, seq in enumerate(seqs):
                if done[i] == seq.num_tokens or budget <= 0:
                    continue
                n = min(seq.num_tokens - done[i], budget)
                rows.append(seq)
                chunks.append(seq.token_ids[done[i] : done[i] + n])
                positions.append(done[i])
                done[i] += n
                budget -= n
                if done[i] == seq.num_tokens:
                    sample.append(seq)
            parts.append(self._forward(rows, chunks, positions, sample))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    @torch.inference_mode()
    def _forward(
        self, seqs: list[Sequence], chunks: list[list[int]], starts: list[int],
        sample: list[Sequence],
    ) -> torch.Tensor:
        """One draft forward: ``chunks[i]`` at positions from ``starts[i]`` of ``seqs[i]``;
        the argmax after the last token of each sequence in ``sample``, on the device
        (queued, not waited for)."""
        inputs = chunk_step_inputs(seqs, chunks, starts, self.block_size)
        hidden = self.runner.run_model(inputs)
        if not sample:
            return torch.empty(0, dtype=torch.int64, device=hidden.device)
        if len(sample) < len(seqs) or inputs.max_query_len > 1:
            chosen = {id(s) for s in sample}
            ends = inputs.query_start_loc[1:] - 1
            rows = torch.tensor([int(ends[i]) for i, s in enumerate(seqs) if id(s) in chosen])
            if hidden.device.type == "cuda":
                # From pinned memory: a copy from pageable memory waits for the stream, so
                # the host could not queue the round's next forwards behind this one.
                rows = rows.pin_memory()
            hidden = hidden[rows.to(hidden.device, non_blocking=True)]
        logits = self.runner.model.compute_logits(hidden)
        return logits[:, : self.num_proposable].argmax(dim=-1)


def chunk_step_inputs(
    seqs: list[Sequence], chunks: list[list[int]], starts: list[int], block_size: int
) -> StepInputs:
    counts = np.fromiter(map(len, chunks), np.int64, len(chunks))
    query_start_loc = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start_loc[1:])
    row_of_token = np.repeat(np.arange(len(seqs)), counts)
    first = np.asarray(starts, dtype=np.int64)
    positions = np.arange(int(query_start_loc[-1])) - query_start_loc[row_of_token] + first[
        row_of_token]
    block_tables = np.zeros((len(seqs), max(len(s.block_table) for s in seqs)), np.int32)
    for row, seq in enumerate(seqs):
        block_tables[row, : len(seq.block_table)] = seq.block_table
    slot_mapping = (block_tables[row_of_token, positions // block_size].astype(np.int64)
                    * block_size + positions % block_size)
    return StepInputs(
        input_ids=np.fromiter((t for c in chunks for t in c), np.int64, len(positions)),
        positions=positions,
        slot_mapping=slot_mapping,
        seq_lens=(first + counts).astype(np.int32),
        query_start_loc=query_start_loc,
        block_tables=block_tables,
        max_query_len=int(counts.max()),
    )
