"""The EAGLE proposer: a draft head fed the target's hidden states guesses the next ``k``
tokens, one head forward per token, before the target verifies them. EAGLE-1/2 heads
(``inference.models.eagle``) read the target's final hidden states and its LM head;
EAGLE-3 heads (``inference.models.eagle3``) read the residual stream entering three target
layers (the runner keeps them: ``LlamaForCausalLM.keep_aux``) and their own LM head over a
draft vocabulary. Everything below holds for both: a "feature" is whatever the head reads.

The head (``inference.models.eagle``) at position p reads token p + 1 and the target's
feature at p, so its KV at p can be written once both are known: the target has computed p
(its feature is in a step's hidden states) and token p + 1 is on the host. Each step the
target's runner hands out the hidden states of every token it computed
(``StepHandle.hidden_states``); ``observe`` keeps each sequence's rows (one copy of the
step's, sliced per sequence), and every ``propose`` first runs the head over all kept rows
whose next token is known ("catch-up": every live sequence, drafting or not, so that no
sequence keeps more than the rows of its last step or two), then drafts: the head's output
at a drafting sequence's last known position gives draft 1 through the target's LM head,
and each further draft feeds the head the previous draft and the previous output.

Its KV cache mirrors the target's, as the draft model's does (``draft_model``): as many
blocks, indexed by the target's block tables, so the block manager's rules (allocation,
preemption, aborts, the prefix cache) govern it with no second manager. Each sequence
remembers how many leading positions hold the head's KV:

- after verification only positions below ``num_computed_tokens`` hold real tokens; the
  target's rows past them (rejected drafts) are dropped, and the head's positions written
  while drafting are never counted: the next catch-up writes them with the real token and
  the target's feature;
- a preemption (``Sequence.num_preemptions`` moved) frees the blocks: back to nothing;
- positions the target did not compute (a prefix-cache hit) have no feature here: the
  head's KV there is what the sequence that filled those blocks wrote (vLLM also has the
  target recompute the last cached block, so that its head rewrites that block; not done
  here). A draft is only ever a proposal: this can cost acceptance, never correctness.

Drafts are the head's argmax; the target's rejection sampler treats them as point masses
(``inference.spec_decode.rejection``), which keeps the target's distribution exactly.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref

import numpy as np
import torch

from inference.config import ResolvedEngineConfig
from inference.layers.attention_metadata import AttentionMetadata
from inference.layers.kv_cache import kv_block_bytes
from inference.model_files import resolve_model
from inference.models.config import ModelConfig
from inference.models.eagle import eagle_head_config, load_eagle_head
from inference.models.eagle3 import Eagle3Head, eagle3_head_config, load_eagle3_head
from inference.models.llama import LlamaForCausalLM
from inference.runner.step_inputs import StepInputs
from inference.sequence import Sequence
from inference.spec_decode.config import SpeculativeConfig
from inference.spec_decode.draft_model import chunk_step_inputs
from pagoda_kernels import warm_up_paged_attention

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _HeadState:
    num_preemptions: int  # the sequence's count when this state was valid
    num_tokens: int = 0  # leading positions whose head KV is valid
    # The target's features not yet read by the head: rows for positions from
    # ``features_start`` on (a view of one step's copy, or several concatenated).
    features_start: int = 0
    features: torch.Tensor | None = None
    # The head's output at position ``num_tokens - 1`` (what draft 1 is read from).
    last_output: torch.Tensor | None = None

    def add_features(self, start: int, rows: torch.Tensor) -> None:
        """Rows of positions ``start, start + 1, ...``; any kept from ``start`` on (a
        verified step's rejected positions) are replaced. A gap (positions the target did
        not compute: a prefix-cache hit) starts afresh."""
        if self.features is not None and self.features_start <= start <= (
                self.features_start + len(self.features)):
            kept = self.features[: start - self.features_start]
            self.features = torch.cat([kept, rows]) if len(kept) else rows
            return
        self.features_start, self.features = start, rows
        if self.num_tokens < start:
            self.num_tokens = start


class EagleProposer:
    """Loads the head beside the target (whose embedding and LM head it uses); ``observe``
    takes each step's hidden states, ``propose`` fills scheduled sequences' drafts."""

    def __init__(
        self, target: ResolvedEngineConfig, target_model_config: ModelConfig,
        spec: SpeculativeConfig, target_model: LlamaForCausalLM,
    ) -> None:
        self.device = target_model.embed_tokens.device
        try:
            folder = resolve_model(spec.model)
            if spec.method == "eagle3":
                config, draft_vocab, norm_first = eagle3_head_config(folder, target_model_config)
                self.head = load_eagle3_head(
                    folder, config, draft_vocab, norm_first, target_model.embed_tokens,
                    target.torch_dtype, self.device, target.max_model_len)  # fmt: skip
            else:
                config = eagle_head_config(folder, target_model_config)
                self.head = load_eagle_head(folder, config, target_model.embed_tokens,
                                            target.torch_dtype, self.device,
                                            target.max_model_len)  # fmt: skip
        except (ValueError, OSError) as exc:
            raise ValueError(f"speculative_config EAGLE head {spec.model!r}: {exc}") from None
        self.config = config
        self.target = target_model
        self.dtype = target.torch_dtype
        self.block_size = target.block_size
        self.max_num_batched_tokens = target.max_num_batched_tokens
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._states: weakref.WeakKeyDictionary[Sequence, _HeadState] = (
            weakref.WeakKeyDictionary())
        if spec.method == "eagle3":
            logger.info("EAGLE-3 head %s: target layers %s, draft vocabulary %d", spec.model,
                        list(target_model.aux_layers), self.head.lm_head.shape[0])  # fmt: skip
        else:
            logger.info("EAGLE head %s: %d layer(s), fc bias %s", spec.model,
                        config.num_layers, self.head.fc_bias is not None)  # fmt: skip

    @property
    def bytes_per_block(self) -> int:
        cfg = self.config
        return kv_block_bytes(cfg.num_layers, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                              self.dtype)  # fmt: skip

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """As many blocks as the target's: the target's block ids index both caches (in
        the model's dtype: the head is small, its cache too)."""
        cfg = self.config
        shape = (num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(cfg.num_layers)
        ]  # fmt: skip
        if self.device.type == "cuda":  # the head's attention variants, before serving
            k_cache, v_cache = self.kv_caches[0]
            layer = self.head.layers[0]
            for decode in (False, True):
                warm_up_paged_attention(k_cache, v_cache, layer.num_heads, layer.scale,
                                        self.max_num_batched_tokens, decode, self.dtype)
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.kv_caches = []
        self.head = None
        self._states.clear()

    # -- the target's features ---------------------------------------------------------
    @torch.inference_mode()
    def observe(
        self, seqs: list[Sequence], num_new_tokens: list[int], hidden_states: torch.Tensor
    ) -> None:
        """A step was launched (not yet counted by the scheduler): ``hidden_states[r]`` is
        the target's feature of the step's r-th token, ``num_new_tokens[i]`` of them for
        ``seqs[i]`` from its ``num_computed_tokens`` on. Copied at once: the runner's
        buffer is the next step's."""
        rows = hidden_states[: sum(num_new_tokens)].clone()
        first = 0
        for seq, n in zip(seqs, num_new_tokens):
            self._state(seq).add_features(seq.num_computed_tokens, rows[first : first + n])
            first += n

    def _state(self, seq: Sequence) -> _HeadState:
        state = self._states.get(seq)
        if state is None or state.num_preemptions != seq.num_preemptions:
            state = self._states[seq] = _HeadState(seq.num_preemptions)
        return state

    # -- drafting ----------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence]) -> None:
        """Catch every live sequence's head KV up with the features it can read, then
        overwrite each sequence's ``draft_token_ids`` (all known tokens; its KV slots
        allocated for them by this step's schedule) with the head's greedy guesses."""
        self._catch_up()
        seqs = [s for s in seqs if s.draft_token_ids]
        if not seqs:
            return
        states = [self._state(s) for s in seqs]
        ready = [i for i, st in enumerate(states)
                 if st.last_output is not None and st.num_tokens == seqs[i].num_tokens - 1]
        if len(ready) < len(seqs):  # cannot happen; drafts of 0 stay lossless (rejected)
            logger.warning("EAGLE: %d sequence(s) without the head's state to draft from",
                           len(seqs) - len(ready))
            seqs, states = [seqs[i] for i in ready], [states[i] for i in ready]
            if not seqs:
                return
        outputs = torch.stack([st.last_output for st in states])
        picks = self._argmax(outputs)
        for seq, token in zip(seqs, picks):
            seq.draft_token_ids[0] = token
        for j in range(1, max(len(s.draft_token_ids) for s in seqs)):
            # Rows (of ``seqs``) still drafting: the budget may have trimmed the others.
            indices = [i for i, s in enumerate(seqs) if len(s.draft_token_ids) > j]
            rows = torch.tensor(indices, device=self.device)
            chosen = [seqs[i] for i in indices]
            step = self._forward(
                chosen, [[s.draft_token_ids[j - 1]] for s in chosen],
                [s.num_tokens - 2 + j for s in chosen], outputs[rows],
            )  # fmt: skip
            for seq, token in zip(chosen, self._argmax(step)):
                seq.draft_token_ids[j] = token
            outputs = outputs.index_copy(0, rows, step)

    def _catch_up(self) -> None:
        """Run the head over every live sequence's readable features (positions the
        target computed whose next token is known), in chunks of the step budget."""
        work: list[tuple[Sequence, _HeadState, int]] = []
        for seq, state in list(self._states.items()):
            if seq.is_finished or state.num_preemptions != seq.num_preemptions:
                del self._states[seq]
                continue
            if state.features is None:
                continue
            start = max(state.num_tokens, state.features_start)
            end = min(state.features_start + len(state.features), seq.num_computed_tokens,
                      seq.num_known_tokens - 1)  # fmt: skip
            if end > start:
                state.num_tokens = start
                work.append((seq, state, end))
        while work:
            budget = self.max_num_batched_tokens
            batch, chunks, starts, features = [], [], [], []
            for seq, state, end in work:
                if budget <= 0:
                    break
                first = state.num_tokens
                n = min(end - first, budget)
                batch.append(seq)
                chunks.append(seq.token_ids[first + 1 : first + 1 + n])
                starts.append(first)
                offset = first - state.features_start
                features.append(state.features[offset : offset + n])
                budget -= n
            outputs = self._forward(batch, chunks, starts, torch.cat(features))
            last_rows = np.cumsum([len(c) for c in chunks]) - 1
            for (_, state, _), first, chunk, row in zip(work, starts, chunks, last_rows):
                state.num_tokens = first + len(chunk)
                state.last_output = outputs[int(row)]
                # The rows read so far are not needed again.
                state.features = state.features[state.num_tokens - state.features_start :]
                state.features_start = state.num_tokens
            work = [(seq, state, end) for seq, state, end in work if state.num_tokens < end]

    def _forward(
        self, seqs: list[Sequence], chunks: list[list[int]], starts: list[int],
        features: torch.Tensor,
    ) -> torch.Tensor:
        """One head forward: ``chunks[i]`` (each the token after its position) at
        positions from ``starts[i]`` of ``seqs[i]``, beside ``features`` (one row a token);
        returns the head's outputs, one row a token."""
        inputs = chunk_step_inputs(seqs, chunks, starts, self.block_size)
        input_ids, positions, meta = _to_device(inputs, self.device)
        return self.head(input_ids, positions, features, self.target.embed_tokens,
                         self.kv_caches, meta)  # fmt: skip

    def _argmax(self, outputs: torch.Tensor) -> list[int]:
        if isinstance(self.head, Eagle3Head):  # its own norm, LM head and vocabulary
            return self.head.draft_ids(outputs).tolist()
        return self.target.compute_logits(outputs).argmax(dim=-1).tolist()


def _to_device(inputs: StepInputs, device: torch.device):
    """A head forward's inputs on the device. On a GPU through pinned memory: a copy from
    pageable memory waits for the stream, and the catch-up of a step that does not draft
    must not make the host sit out the target's step in flight."""

    def to_device(array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if device.type == "cuda":
            tensor = tensor.pin_memory()
        return tensor.to(device, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=to_device(inputs.slot_mapping),
        block_tables=to_device(inputs.block_tables),
        seq_lens=to_device(inputs.seq_lens),
        query_start_loc=to_device(inputs.query_start_loc.astype(np.int32)),
        max_query_len=inputs.max_query_len,
    )
    return to_device(inputs.input_ids), to_device(inputs.positions), meta
