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

A drafting round is one forward for each draft, queued without waiting: a catch-up over
the tokens the draft has not run (in steady state one or two a sequence, one decode row a
token: ``_MAX_TOKEN_ROWS``), then one decode row a sequence for each further draft, fed the
previous pick on the device. On a GPU each is one replay of a decode graph that ends in the
LM head and the argmax (``_pick``); only a longer catch-up (a new prompt, a sequence that
did not draft for a while) runs a mixed step and then the head eagerly.

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

# A verified round leaves a sequence's draft KV one token behind its tokens (a draft was
# rejected: the target's token after the accepted ones) or two (all were accepted: the last
# draft, never run through the draft, and the target's token after it). The catch-up runs
# up to this many tokens a sequence as decode rows, one a token: rows of one sequence at
# consecutive positions read each other's KV, as the tokens of one query do (each layer
# writes every row's KV before any row attends).
_MAX_TOKEN_ROWS = 2


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
    # Its steps' rows: at most disable_by_batch_size sequences draft, with up to
    # _MAX_TOKEN_ROWS rows each in a catch-up (and a step has no more rows than tokens). Its
    # decode graphs (which end in the LM head: [rows, vocab] logits in the graph pool) go
    # no larger.
    max_num_seqs = min(_MAX_TOKEN_ROWS * min(target.max_num_seqs, spec.disable_by_batch_size),
                       target.max_num_batched_tokens)
    config = dataclasses.replace(
        target, model=str(path), tokenizer=None, speculative_config=None,
        load_format=extra.get("load_format", target.load_format),
        quantization=resolve_quantization(None, model_config.quantization_config),
        max_num_seqs=max_num_seqs,
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
        """As many blocks as the target's: the target's block ids index both caches. The
        decode graphs end in the LM head and the pick (``_pick``)."""
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.capture_graphs(decode_head=self._pick)

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

        The guesses stay on the device between the draft's forwards: each forward leaves
        its picks in ``sampled_ids`` and the next reads them as placeholders (``-1 - r``
        stands for ``sampled_ids[r]``, resolved inside the captured graph), so the host
        queues every forward of the round without waiting and reads all guesses back once,
        at the end."""
        seqs = [s for s in seqs if s.draft_token_ids]
        if not seqs:
            return
        starts = [self._valid_prefix(seq) for seq in seqs]
        picks, rows = self._catch_up(seqs, starts)
        forwards = [(picks, rows)]  # each forward's picks; sequence index -> its row there
        for j in range(1, max(len(s.draft_token_ids) for s in seqs)):
            live = [i for i, s in enumerate(seqs) if len(s.draft_token_ids) > j]
            picks = self._forward([seqs[i] for i in live], [[-1 - rows[i]] for i in live],
                                  [seqs[i].num_tokens - 1 + j for i in live])
            rows = {i: row for row, i in enumerate(live)}
            forwards.append((picks, rows))
        values = torch.cat([picks for picks, _ in forwards]).tolist()  # the round's one wait
        at = 0
        for j, (picks, rows) in enumerate(forwards):
            for i, row in rows.items():
                seqs[i].draft_token_ids[j] = values[at + row]
            at += len(picks)
        for seq in seqs:  # positions up to the last draft's are written, not that one
            self._kv[seq].num_tokens = seq.num_tokens - 1 + len(seq.draft_token_ids)

    def _valid_prefix(self, seq: Sequence) -> int:
        state = self._kv.get(seq)
        if state is None or state.num_preemptions != seq.num_preemptions:
            state = self._kv[seq] = _DraftKV(0, seq.num_preemptions)
        # Past num_computed_tokens lie rejected guesses (or nothing yet).
        state.num_tokens = min(state.num_tokens, seq.num_computed_tokens)
        return state.num_tokens

    def _catch_up(
        self, seqs: list[Sequence], starts: list[int]
    ) -> tuple[torch.Tensor, dict[int, int]]:
        """Run the tokens from each sequence's valid prefix to its last token through the
        draft (in chunks of the step budget); returns the picks (on the device, and in
        ``sampled_ids``) and, per sequence index, the row of its first draft there.

        Where no sequence lags by more than ``_MAX_TOKEN_ROWS`` tokens (every round after
        the first), each token is a row of its own: a decode step, which replays a decode
        graph like the round's other forwards. Otherwise a row is a sequence's chunk; a
        chunk takes the sequences in order."""
        one_per_row = max(s.num_tokens - n for s, n in zip(seqs, starts)) <= _MAX_TOKEN_ROWS
        parts: list[torch.Tensor] = []
        last_rows: dict[int, int] = {}
        done = list(starts)
        at = 0
        while len(last_rows) < len(seqs):
            budget = self.max_num_batched_tokens
            rows, chunks, positions = [], [], []
            for i, seq in enumerate(seqs):
                n = min(seq.num_tokens - done[i], budget)
                if n <= 0:  # caught up, or the budget spent
                    continue
                width = 1 if one_per_row else n
                for start in range(done[i], done[i] + n, width):
                    rows.append(seq)
                    chunks.append(seq.token_ids[start : start + width])
                    positions.append(start)
                done[i] += n
                budget -= n
                if done[i] == seq.num_tokens:
                    last_rows[i] = at + len(rows) - 1
            parts.append(self._forward(rows, chunks, positions))
            at += len(parts[-1])  # a decode graph's picks include its padding rows
        if len(parts) == 1:
            return parts[0], last_rows
        # Each chunk left its picks at the start of sampled_ids: the first drafts go there.
        picks = torch.cat(parts)[self._on_device([last_rows[i] for i in range(len(seqs))])]
        self.runner.sampled_ids[: len(picks)].copy_(picks)
        return picks, {i: i for i in range(len(seqs))}

    @torch.inference_mode()
    def _forward(
        self, seqs: list[Sequence], chunks: list[list[int]], starts: list[int]
    ) -> torch.Tensor:
        """One draft forward: ``chunks[i]`` at positions from ``starts[i]`` of ``seqs[i]``;
        the pick after each row's last token, on the device and in ``sampled_ids[:rows]``
        (queued, not waited for)."""
        inputs = chunk_step_inputs(seqs, chunks, starts, self.block_size)
        graphs = self.runner.graphs
        if inputs.max_query_len == 1 and graphs is not None and graphs.fits(inputs):
            # Decode graphs end in ``_pick``. Their output is overwritten by the graph's
            # next replay (the round's next forward, at the same batch): copied.
            return graphs.run(inputs).clone()
        hidden = self.runner.run_model(inputs)
        if inputs.max_query_len > 1:
            hidden = hidden[self._on_device(inputs.query_start_loc[1:] - 1)]
        return self._pick(hidden)

    def _pick(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's greedy pick, also left in ``sampled_ids`` for the next forward's
        placeholders. Recorded at the end of the draft's decode graphs."""
        logits = self.runner.model.compute_logits(hidden)
        picks = logits[:, : self.num_proposable].argmax(dim=-1)
        self.runner.sampled_ids[: len(picks)].copy_(picks)
        return picks

    def _on_device(self, rows: np.ndarray | list[int]) -> torch.Tensor:
        """Row indices on the device, queued: from pinned memory on a GPU (a copy from
        pageable memory waits for the stream, so the host could not queue the round's next
        forwards behind this one)."""
        index = torch.as_tensor(rows, dtype=torch.int64)
        if self.runner.device.type == "cuda":
            index = index.pin_memory()
        return index.to(self.runner.device, non_blocking=True)


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
