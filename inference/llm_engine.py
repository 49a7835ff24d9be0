"""The step loop: schedule -> run -> sample -> update.

A request's life, top to bottom:
  ``add_request``  validates and tokenizes, creates ``n`` sequences, queues them;
  ``step``         the scheduler picks this step's tokens (``Scheduler.schedule``), the model
                   runner computes them and samples for sequences whose tokens are all
                   computed (``ModelRunner.launch``), and the scheduler counts them as
                   computed (``Scheduler.on_step_launched``); once the sampled ids are on
                   the host the scheduler puts them in place (``Scheduler.on_step_finished``),
                   the output processor detokenizes them, checks the stop conditions and
                   shapes the outputs (``OutputProcessor``), and sequences that stopped give
                   their KV blocks back (``Scheduler.finish``);
                   a structured-output request first waits here, outside the scheduler,
                   until its grammar matcher is built (``inference.structured_output``);
  ``abort_request`` frees a request's blocks at any point.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from inference.config import EngineConfig
from inference.engine_messages import EngineStats
from inference.engine_setup import build_engine, ensure_writable_kernel_cache, resolve_engine_config
from inference.executor.interface import ModelExecutor, PendingStep
from inference.generation_defaults import generation_defaults
from inference.lora.registry import LoRARegistry, lora_stats
from inference.lora.request import LoRARequest
from inference.output_processor import RequestState
from inference.outputs import RequestOutput
from inference.reconfigure import (
    ChangePlan,
    LiveChange,
    ReconfigureError,
    finish_change,
    plan_change,
    start_change,
)
from inference.sampler import (
    PromptLogprobsRequest,
    RowLogprobs,
    SamplerOutput,
    SamplingMetadata,
    has_penalties,
)
from inference.sampling_params import SamplingParams, check_max_logprobs
from inference.scheduler import ScheduledBatch
from inference.sequence import Sequence, SequenceStatus
from inference.spec_decode.drafting import SpecDecoder, VerifiedTokens
from inference.text_output import stop_token_ids

logger = logging.getLogger(__name__)

# With nothing else to run, how long a step waits for a grammar being built (not spinning).
_GRAMMAR_WAIT_S = 0.01


@dataclass
class _LaunchedStep:
    handle: PendingStep
    seqs: list[Sequence]  # the sampled sequences, in sample-row order
    positions: list[int]  # where each one's placeholder sits in its token_ids
    # Penalties read the tokens: the next step must see real ids.
    needs_sync: bool
    # Sequences whose prompt logprobs the step computes, with what was asked of the runner.
    prompt_logprobs: list[tuple[Sequence, PromptLogprobsRequest]]
    has_grammar: bool  # some sampled sequence is constrained
    # Sample row -> whether its grammar ended, once the matchers have consumed the step's
    # tokens (``LLMEngine._advance_grammars``: from the next step's mask fill or from
    # ``_complete``, whichever comes first).
    grammar_ended: dict[int, bool] | None = None
    # Speculative decoding: turns the samples of a step that verified drafts (one per
    # position) into one first token per sequence (``extra``: the accepted ones after it).
    split: Callable[..., VerifiedTokens] | None = None
    extra: list[list[tuple[int, RowLogprobs | None]]] | None = None
    # Each sampled row's drafts (a step that verified some; None otherwise).
    drafts: list[list[int]] | None = None
    # Pipelined n-gram drafts (``LLMEngine._extend_tentatively``): sample row -> how many
    # drafts of this step its sequence took as accepted, for the next step, before this
    # one's picks were read; ``void``: rows whose own tentative extension did not hold
    # (their results are dropped).
    tentative: dict[int, int] = field(default_factory=dict)
    void: set[int] = field(default_factory=set)
    _output: SamplerOutput | None = None
    _read: bool = False
    wait_s = 0.0  # how long reading the result waited for the device (and the copy back)

    def result(self) -> SamplerOutput | None:
        """The step's sampled tokens, one per sampled sequence (waits for the device
        once)."""
        if not self._read:
            started = time.perf_counter()
            self._output, self._read = self.handle.result(), True
            self.wait_s = time.perf_counter() - started
            if self.split is not None and self._output is not None:
                verified = self.split(self._output, void=self.void)
                self._output, self.extra = verified.first, verified.extra
        return self._output


@dataclass
class _FillAhead:
    """The masks of a launched step's constrained sequences, being filled on their own
    thread for the next launch (``LLMEngine._start_fill_ahead``)."""

    step: _LaunchedStep
    matchers: list
    future: Future


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        ensure_writable_kernel_cache()
        self.config, self.model_path, self.model_config = resolve_engine_config(config)
        config = self.config
        self.model_name = config.served_model_name or self.model_path.name
        for note in config.ignored_settings():
            logger.info("%s", note)
        # Defaults of the sampling parameters a request leaves out (--generation-config).
        self.generation_defaults = generation_defaults(config, self.model_path)
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.kv_cache_dtype = config.kv_cache_torch_dtype
        parts = build_engine(config, self.model_path, self.model_config)
        self.tokenizer = parts.tokenizer
        self.eos_token_ids = parts.eos_token_ids
        # One GPU: a ModelRunner in this process; tensor parallel: worker processes.
        self.runner: ModelExecutor = parts.runner
        self.num_total_blocks = parts.num_total_blocks
        self.startup_phases = parts.startup_phases
        self.block_manager = parts.block_manager
        self.scheduler = parts.scheduler
        self.output_processor = parts.output_processor
        self.grammars = parts.grammars
        speculative = config.speculative()
        # Speculative decoding: proposes drafts before each step is scheduled (a draft
        # model fills them in once the schedule has given them KV slots).
        # With async scheduling n-gram drafts are pipelined: the next verify step is
        # launched before the one in flight is read, on the guess that all its drafts
        # hold (``_extend_tentatively``); a draft model's need every token known.
        self._pipelined_drafts = (
            speculative is not None and parts.draft is None and config.async_scheduling)
        self.spec_decoder = (
            SpecDecoder(speculative, parts.draft, pipelined=self._pipelined_drafts)
            if speculative is not None else None)
        if speculative is not None:
            logger.info("speculative decoding: %s", speculative.summary())
        self.requests: dict[str, RequestState] = {}
        # Structured-output requests wait here until their matcher is built.
        self._awaiting_grammar: list[tuple[RequestState, Future]] = []
        # Async scheduling (on by default): step n+1 is launched before step n's tokens
        # are read back. Off, each step completes before the next is scheduled.
        self.async_scheduling = config.async_scheduling
        self._in_flight: _LaunchedStep | None = None
        self._pending_outputs: list[RequestOutput] = []
        # Structured outputs with async scheduling on one device: once a step is launched,
        # a thread of its own waits for its tokens, advances its matchers by them and fills
        # their next masks (``_fill_ahead``), while this thread completes the step before
        # (outputs, stop checks) and schedules and launches the next, whose sampler then
        # only takes the masks. A mask needs the token before it, so each step's fill is
        # on the critical path; only the host's other work can hide beside it.
        self._fill_ahead_pool: ThreadPoolExecutor | None = None
        self._filled_ahead: _FillAhead | None = None
        # A live change waiting for its CUDA graphs (``begin_reconfigure``).
        self._live_change: LiveChange | None = None
        self._next_seq_id = 0
        self.computed_tokens_total = 0  # tokens run through the model (prefix hits excluded)
        # Seconds the host spent waiting for steps' results from the device: beside the
        # steps' wall time, it splits them into device time and host time (the step trace).
        self.device_wait_s_total = 0.0
        # Sequences with prompt positions still to score (prompt_logprobs): steps look for
        # prompt-logprob work only while there are any.
        self._unscored: set[Sequence] = set()
        # LoRA adapters requests may name, each checked once (inference.lora).
        self.loras = LoRARegistry(config.enable_lora, self.model_config, config.max_lora_rank)

    # -- intake ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and queue a request (``lora_request``: the LoRA adapter it runs with).
        Raises ValueError, changing nothing, on bad input."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.loras.check(lora_request)
        params = (params or SamplingParams()).clone()
        params.validate()
        check_max_logprobs(params, self.config.max_logprobs)
        prompt_text, prompt_ids = self._tokenize(prompt)
        max_len = self.config.max_model_len
        if len(prompt_ids) >= max_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens but max_model_len is {max_len}: "
                "the prompt must leave room for at least one generated token"
            )
        if params.max_tokens is None:
            params.max_tokens = max_len - len(prompt_ids)
        elif len(prompt_ids) + params.max_tokens > max_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{len(prompt_ids) + params.max_tokens} exceeds max_model_len ({max_len})"
            )
        if params.min_tokens > params.max_tokens:
            raise ValueError(
                f"min_tokens ({params.min_tokens}) exceeds max_tokens ({params.max_tokens})"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        grammar: Future | None = None
        if params.structured_outputs is not None:
            source = self.grammars.check(params.structured_outputs)
            grammar = self.grammars.matcher(params.structured_outputs, source)
        params.all_stop_token_ids = stop_token_ids(params, self.eos_token_ids)

        arrival_time = time.time() if arrival_time is None else arrival_time
        seqs = []
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                # Tensor parallel: workers seed their own from (seq id, seed); the engine
                # process keeps off the GPU.
                on_host = self.config.tensor_parallel_size > 1
                generator = torch.Generator(device="cpu" if on_host else self.device)
                generator.manual_seed(params.seed + index)
            seq = Sequence(
                self._next_seq_id, request_id, index, prompt_ids, params, arrival_time, generator,
                lora_request,
            )
            self._next_seq_id += 1
            seqs.append(seq)
        request = self.output_processor.new_request(
            request_id, prompt_text, prompt_ids, params, seqs, arrival_time
        )
        if lora_request is not None:
            self.runner.prefetch_lora(lora_request)
        self.requests[request_id] = request
        if grammar is not None:
            self._awaiting_grammar.append((request, grammar))
            return
        for seq in seqs:
            self._queue(seq)

    def _queue(self, seq: Sequence) -> None:
        self.scheduler.add(seq)
        if seq.prompt_logprobs is not None and seq.num_prompt_tokens > 1:
            self._unscored.add(seq)

    def _admit_grammar_requests(self) -> None:
        """Queue the structured-output requests whose matchers are built (each sequence
        gets its own copy); fail those whose grammar could not be built."""
        scheduler = self.scheduler
        idle = not scheduler.waiting and not scheduler.running and self._in_flight is None
        if idle and not self._pending_outputs:
            wait_futures(
                [future for _, future in self._awaiting_grammar],
                timeout=_GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED,
            )
        waiting = []
        for request, future in self._awaiting_grammar:
            if request.finished:
                continue  # aborted while its grammar was being built
            if not future.done():
                waiting.append((request, future))
                continue
            error = future.exception()
            if error is not None:
                logger.error("request %s: grammar failed: %s", request.request_id, error)
                for seq in request.seqs:
                    self.scheduler.finish(seq)
                    seq.finish_reason = "abort"
                self._emit(request, self._pending_outputs)
                continue
            template = future.result()
            for seq in request.seqs:
                seq.grammar = template.deep_copy()
                self._queue(seq)
        self._awaiting_grammar = waiting

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give the prompt as token ids")
            ids = self.tokenizer(prompt).input_ids
            if not ids:
                # A word-level tokenizer may drop every word it does not know.
                raise ValueError(f"prompt {prompt[:40]!r} tokenizes to no tokens")
            return prompt, ids
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        return None, ids

    def abort_request(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            for seq in request.seqs:
                if not seq.is_finished:
                    self._finish(seq, "abort")
                self._unscored.discard(seq)
            self._emit(request, self._pending_outputs)

    def leave_text_to_server(self) -> None:
        """From now on requests get token ids and logprobs only: the server makes their text
        and finds their stop strings (``inference/text_output.py``), and says which
        completions a stop string ended (``stop_sequences``)."""
        self.output_processor.text = False

    def stop_sequences(self, stops: list[tuple[str, int, str]]) -> None:
        """Finish the (request id, completion index) completions with ``finish_reason``
        "stop" and the stop string found in their text; unknown or finished ones are
        skipped (the request may have finished meanwhile)."""
        touched: dict[str, RequestState] = {}
        for request_id, index, stop in stops:
            request = self.requests.get(request_id)
            if request is None or not 0 <= index < len(request.seqs):
                continue
            seq = request.seqs[index]
            if seq.is_finished:
                continue
            self._finish(seq, "stop", stop)
            touched[request_id] = request
        for request in touched.values():
            self._emit(request, self._pending_outputs)

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | None = None) -> None:
        """End a running or waiting completion from outside the step (abort, a stop string
        the server found): its blocks go back and it is never scored."""
        self._unscored.discard(seq)
        self.scheduler.finish(seq)
        seq.finish_reason, seq.stop_reason = reason, stop_reason

    # -- the loop ----------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending_outputs) or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        """One scheduling step. With async scheduling the step is launched first and the
        previous step's tokens are processed while the device runs it, so the host's work
        (stop checks, detokenization, outputs, the next schedule) hides behind the GPU's."""
        if self._live_change is not None:
            self.poll_reconfigure()  # a step boundary: a change whose graphs are ready
        if self._awaiting_grammar:
            self._admit_grammar_requests()
        outputs, self._pending_outputs = self._pending_outputs, []
        if self.spec_decoder is not None:
            self._propose_drafts(outputs)
        batch = self.scheduler.schedule()
        launched = self._launch(batch) if batch else None
        previous, self._in_flight = self._in_flight, launched
        overlapped = launched is not None and self.async_scheduling and not launched.needs_sync
        if overlapped and launched.has_grammar:
            # Before the previous step completes, so the fill overlaps that too.
            self._start_fill_ahead(launched, previous)
        if previous is not None:
            self._complete(previous, outputs)
        if launched is not None and not overlapped:
            self._in_flight = None
            self._complete(launched, outputs)
        return outputs

    def _propose_drafts(self, outputs: list[RequestOutput]) -> None:
        """A draft model needs every token known: where this step may speculate, the step
        in flight completes first (above the batch size where drafts stop, steps overlap
        as usual). N-gram drafts are pipelined instead: the step in flight's drafts are
        taken as accepted (``_extend_tentatively``) and the next drafts guessed from
        them, so this step is launched while that one runs."""
        running = self.scheduler.running
        if self._in_flight is not None and self.spec_decoder.may_draft(len(running)):
            if self._pipelined_drafts:
                self._extend_tentatively(self._in_flight)
            else:
                previous, self._in_flight = self._in_flight, None
                self._complete(previous, outputs)
        self.spec_decoder.propose(running)

    def _extend_tentatively(self, step: _LaunchedStep) -> None:
        """Each sequence the step in flight verifies drafts for continues, until that step
        is read, as if they all were accepted: its first pick's placeholder takes the
        first draft's value, the other drafts follow, and the token after them is a
        placeholder for the pick the runner leaves in ``sampled_ids`` (the bonus: a
        verified row's last pick). All of them stay pending (never hashed, never
        output); ``_restore_tentative`` undoes this once the step is read."""
        if step.drafts is None:
            return
        for i, (seq, drafts) in enumerate(zip(step.seqs, step.drafts, strict=True)):
            if (not drafts or i in step.void or seq.status is not SequenceStatus.RUNNING
                    or seq.num_tokens != step.positions[i] + 1):
                continue
            seq.token_ids[-1] = drafts[0]
            seq.token_ids.extend(drafts[1:])
            seq.append_placeholder(-1 - i)
            seq.num_pending_tokens += len(drafts) - 1
            seq.num_computed_tokens += len(drafts)
            step.tentative[i] = len(drafts)

    def _restore_tentative(self, step: _LaunchedStep) -> list[tuple[int, list[int]]]:
        """Before a step's picks are taken in: each tentatively extended sequence back to
        how the step left it (its first pick's placeholder last). Returns, per such row,
        what the next step (now in flight) added after the extension: its placeholder,
        if that step ran the sequence."""
        restored = []
        for i, num_drafts in step.tentative.items():
            seq = step.seqs[i]
            if seq.is_finished:
                continue  # aborted meanwhile: its placeholders are gone
            position = step.positions[i]
            after = seq.token_ids[position + num_drafts + 1 :]
            del seq.token_ids[position + 1 :]
            seq.num_pending_tokens = 1
            if seq.status is SequenceStatus.RUNNING:
                seq.num_computed_tokens = position
            restored.append((i, after))
        return restored

    def _settle_tentative(
        self, step: _LaunchedStep, restored: list[tuple[int, list[int]]]
    ) -> None:
        """After a step's picks are taken in: a row whose drafts were all accepted is just
        where the next step (in flight) assumed, which gets its launch's effects back (the
        token it computes, its placeholder); any other row of that step is void."""
        following = self._in_flight if self._in_flight is not step else None
        for i, after in restored:
            seq = step.seqs[i]
            if not after:
                continue  # the next step did not run it: its state is already right
            row = -1 - after[0]
            held = (
                seq.status is SequenceStatus.RUNNING
                and len(step.extra[i]) == step.tentative[i]
                and seq.num_tokens == step.positions[i] + step.tentative[i] + 1
            )
            if held:
                seq.num_computed_tokens += 1
                seq.append_placeholder(after[0])
                self.block_manager.cache_full_blocks(seq)
            elif following is not None:
                following.void.add(row)

    def _launch(self, batch: ScheduledBatch) -> _LaunchedStep:
        now = time.time()
        seqs, counts = batch.seqs, batch.num_new_tokens
        self.computed_tokens_total += batch.num_batched_tokens
        sample_rows = batch.sample_rows
        sampled_seqs = [seqs[row] for row in sample_rows]
        if self.spec_decoder is not None:
            self.spec_decoder.fill(sampled_seqs)
        drafts = [list(s.draft_token_ids) for s in sampled_seqs]
        speculating = any(drafts)
        sampling = self._sampling_metadata(sampled_seqs, drafts if speculating else None)
        if self._unscored:
            sampling.prompt_logprobs = _prompt_logprobs_requests(seqs, counts, self._unscored)
        constrained = [row for row, s in enumerate(sampled_seqs) if s.grammar is not None]
        if constrained:
            if speculating:  # rows of the expanded sampling metadata (never drafted)
                first_rows = np.cumsum([0] + [len(d) + 1 for d in drafts])
                sampling.bitmask_rows = [int(first_rows[row]) for row in constrained]
            # Filled once this step's forward pass is queued (``SamplingMetadata``), after
            # the step in flight's tokens have advanced the matchers.
            else:
                sampling.bitmask_rows = constrained
            sampling.fill_token_bitmask = partial(
                self._fill_bitmask, self._in_flight,
                [sampled_seqs[row].grammar for row in constrained],
            )  # fmt: skip
        handle = self.runner.launch(seqs, counts, sample_rows, sampling)
        if handle.hidden_states is not None:  # EAGLE: the head reads the target's features
            self.spec_decoder.observe(seqs, counts, handle.hidden_states)
        prompt_logprobs = [(seqs[r.row], r) for r in sampling.prompt_logprobs]
        positions = self.scheduler.on_step_launched(batch, now)
        # A step that verifies a draft model's drafts completes before the next is
        # scheduled: how many tokens each row gains is known only then (pipelined n-gram
        # drafts guess it: ``_extend_tentatively``).
        needs_sync = (speculating and not self._pipelined_drafts) or any(
            has_penalties(s.params) for s in sampled_seqs)
        split = None
        if speculating:
            split = partial(self.spec_decoder.split, seqs=sampled_seqs, drafts=drafts)
        return _LaunchedStep(
            handle, sampled_seqs, positions, needs_sync, prompt_logprobs, bool(constrained),
            split=split, drafts=drafts if speculating else None,
        )

    def _fill_bitmask(self, in_flight: _LaunchedStep | None, matchers: list) -> np.ndarray:
        ahead = self._join_fill_ahead(in_flight) if in_flight is not None else None
        if ahead is None:
            if in_flight is not None:
                self._advance_grammars(in_flight)
            return self.grammars.fill_bitmask(matchers)
        filled, bitmask = ahead
        if len(filled) == len(matchers) and all(a is b for a, b in zip(filled, matchers)):
            return bitmask
        # The batch changed since (admissions, preemptions, finishes): rows filled ahead
        # are taken, the others filled now.
        index = {id(m): row for row, m in enumerate(filled)}
        rows = [index.get(id(m), -1) for m in matchers]
        mask = bitmask[[max(row, 0) for row in rows]]
        missing = [i for i, row in enumerate(rows) if row < 0]
        if missing:
            mask[missing] = self.grammars.fill_bitmask([matchers[i] for i in missing])
        return mask

    def _start_fill_ahead(self, step: _LaunchedStep, previous: _LaunchedStep | None) -> None:
        """On a thread of its own: wait for the launched ``step``'s tokens, advance its
        constrained sequences' matchers by them and fill their next masks. Only that
        thread touches those matchers until ``_join_fill_ahead`` (the engine thread's
        completion of ``previous`` meanwhile reads only what the matchers said then:
        ``grammar_ended``). Sequences whose grammar ended with ``previous``'s token are
        left out: their next token is past the end and they finish with ``previous``.
        Steps verifying drafts (reading them splits rows) and executors whose results
        must be read on the launching thread keep the fill inside the next launch."""
        if (not self.runner.concurrent_results or step.split is not None
                or step.grammar_ended is not None):
            return
        if self._filled_ahead is not None:
            # Not expected (this launch joined the fill for the step before), but two
            # fills must never share matchers: wait for it; its masks are not wanted.
            self._join_fill_ahead(None)
        ended = set()
        if previous is not None and previous.grammar_ended:
            ended = {id(previous.seqs[row]) for row, end in previous.grammar_ended.items() if end}
        rows = [i for i in self._grammar_rows(step) if id(step.seqs[i]) not in ended]
        if not rows:
            return
        if self._fill_ahead_pool is None:
            self._fill_ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="fill-ahead")
        matchers = [step.seqs[i].grammar for i in rows]
        future = self._fill_ahead_pool.submit(self._fill_ahead, step, rows, matchers)
        self._filled_ahead = _FillAhead(step, matchers, future)

    def _fill_ahead(self, step: _LaunchedStep, rows: list[int], matchers: list) -> np.ndarray:
        self._advance_grammars(step, rows)
        return self.grammars.fill_bitmask(matchers)

    def _join_fill_ahead(self, step: _LaunchedStep | None) -> tuple[list, np.ndarray] | None:
        """Wait for a fill ahead of ``step`` (its matchers and their masks) or for any
        other still running (whose masks are dropped); None when none ran for ``step``."""
        ahead, self._filled_ahead = self._filled_ahead, None
        if ahead is None:
            return None
        bitmask = ahead.future.result()
        return (ahead.matchers, bitmask) if ahead.step is step else None

    @staticmethod
    def _grammar_rows(step: _LaunchedStep) -> list[int]:
        return [
            i for i, seq in enumerate(step.seqs) if seq.grammar is not None and not seq.is_finished
        ]

    def _advance_grammars(self, step: _LaunchedStep, rows: list[int] | None = None) -> None:
        """Feed a step's sampled tokens to its constrained sequences' matchers (``rows``,
        default: those still running), once."""
        if step.grammar_ended is not None or not step.has_grammar:
            return
        step.grammar_ended = {}
        sampled = step.result()
        if sampled is None:
            return
        rows = self._grammar_rows(step) if rows is None else rows
        if rows:
            ended = self.grammars.advance(
                [step.seqs[i].grammar for i in rows], [sampled.token_ids[i] for i in rows]
            )
            step.grammar_ended = dict(zip(rows, ended))

    def _complete(self, step: _LaunchedStep, outputs: list[RequestOutput]) -> None:
        """Put a launched step's sampled tokens in place of their placeholders, then let the
        output processor take each one in (text, logprobs, stop conditions) and emit
        outputs; sequences that stopped leave the scheduler."""
        if self._filled_ahead is not None and self._filled_ahead.step is step:
            self._join_fill_ahead(step)  # its masks are for a launch that did not come
        sampled = step.result()
        self.device_wait_s_total += step.wait_s
        if sampled is None:
            return
        restored = self._restore_tentative(step) if step.tentative else []
        self._advance_grammars(step)
        grammar_ended = step.grammar_ended or {}
        processor = self.output_processor
        for (seq, asked), result in zip(step.prompt_logprobs, sampled.prompt_logprobs, strict=True):
            processor.add_prompt_logprobs(seq, asked.target_ids, result)
        void = step.void
        if void:
            rows = [i for i in range(len(step.seqs)) if i not in void]
            self.scheduler.on_step_finished(
                [step.seqs[i] for i in rows], [step.positions[i] for i in rows],
                [sampled.token_ids[i] for i in rows])
        else:
            self.scheduler.on_step_finished(step.seqs, step.positions, sampled.token_ids)
        touched: dict[str, RequestState] = {}
        now = time.time()
        for i, seq in enumerate(step.seqs):
            if seq.is_finished or i in void:
                continue  # aborted, or stopped by an earlier token while this step ran
            request = self.requests[seq.request_id]
            finished = processor.process_token(
                request, seq, sampled.token_ids[i], sampled.logprobs[i], now,
                grammar_ended.get(i, False),
            )  # fmt: skip
            # Accepted drafts, one at a time, as if each had been its own step: a stop
            # (EOS, stop string, max_tokens) ends the sequence there.
            for token_id, row_logprobs in step.extra[i] if step.extra else ():
                if finished:
                    break
                self.scheduler.on_draft_accepted(seq, token_id)
                finished = processor.process_token(request, seq, token_id, row_logprobs, now)
            if finished:
                self.scheduler.finish(seq)
            touched[request.request_id] = request
        if restored:
            self._settle_tentative(step, restored)
        for request in touched.values():
            self._emit(request, outputs)

    def _emit(self, request: RequestState, outputs: list[RequestOutput]) -> None:
        """Add the request's output (if its output kind has one now) to ``outputs``; a
        finished request leaves the engine."""
        output = self.output_processor.make_output(request)
        if output is None:
            return
        outputs.append(output)
        if output.finished:
            self.requests.pop(request.request_id, None)

    def _sampling_metadata(
        self, seqs: list[Sequence], drafts: list[list[int]] | None = None
    ) -> SamplingMetadata:
        """One row per sequence; with ``drafts``, one per position each verifies (its
        drafts' and one more), the j-th counting j more output tokens (min_tokens)."""
        if drafts is not None:
            expanded = [(s, j) for s, d in zip(seqs, drafts) for j in range(len(d) + 1)]
        else:
            expanded = [(s, 0) for s in seqs]
        # Token histories only for rows whose sampling reads them (penalties, min_tokens):
        # copying every sequence's tokens every step would cost more than the step.
        prompts, outputs, counts = [], [], []
        for seq, offset in expanded:
            p = seq.params
            penalized = (
                p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
            )
            # Pending placeholders count towards min_tokens; penalised rows have none (their
            # steps complete before the next is scheduled).
            counts.append(seq.num_tokens - seq.num_prompt_tokens + offset)
            prompts.append(seq.prompt_token_ids if p.repetition_penalty != 1.0 else [])
            outputs.append(seq.output_token_ids if penalized else [])
        return SamplingMetadata(
            params=[s.params for s, _ in expanded],
            prompt_token_ids=prompts,
            output_token_ids=outputs,
            num_output_tokens=counts,
            generators=[s.generator for s, _ in expanded],
            draft_token_ids=drafts,
        )

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Check an adapter so that requests may name it (vLLM's ``add_lora``); its tensors
        load when a step first needs them. ValueError for one that cannot be served."""
        self.loras.check(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter: new requests may not name it, and it leaves its device slot
        and the CPU cache unless requests still run with it (they finish with it; its slot
        then goes least recently used). False if no adapter has that id."""
        request = self.loras.remove(lora_int_id)
        live = (*self.scheduler.running, *self.scheduler.waiting)
        if request is not None and all(s.lora_request != request for s in live):
            self.runner.forget_lora(request)
        return request is not None

    # -- live settings (``inference.reconfigure``) ----------------------------------------
    def reconfigure(self, changes: dict, dry_run: bool = False) -> tuple[ChangePlan, float]:
        """Plan ``changes`` (setting -> value) and, unless ``dry_run``, make them now,
        between steps, waiting for any CUDA graphs they need (no step runs meanwhile: the
        caller is the step loop). Returns the plan and the seconds it took.
        ReconfigureError (changing nothing) for a change that cannot be made live."""
        if dry_run:
            return plan_change(self, changes), 0.0
        change = self.begin_reconfigure(changes)
        if not change.done:
            change.wait_captured()
            self.poll_reconfigure()
        return change.result()

    def begin_reconfigure(self, changes: dict) -> LiveChange:
        """Start ``changes`` between steps: the step in flight completes first (its outputs
        go out with the next step). A change that needs CUDA graphs the runner lacks is
        ``done`` only later: its graphs are recorded in the background while ``step`` goes
        on under the old limits, and the first step after they are ready makes it (or
        refuses it, if the capture failed). ReconfigureError for a change that cannot be
        made, and (409) while another one waits for its graphs."""
        if self._live_change is not None:
            raise ReconfigureError(409, self._live_change.under_way())
        self._settle()
        change = start_change(self, plan_change(self, changes))
        if not change.done:
            self._live_change = change
        return change

    def poll_reconfigure(self) -> None:
        """At a step boundary: the change whose graphs are ready takes effect, or is
        refused; nothing to do otherwise."""
        change = self._live_change
        if change is None or not change.captured:
            return
        self._live_change = None
        self._settle()
        finish_change(self, change)

    def _settle(self) -> None:
        """Complete the step in flight (its outputs go out with the next step)."""
        if self._in_flight is not None:
            previous, self._in_flight = self._in_flight, None
            self._complete(previous, self._pending_outputs)

    # -- lifecycle and health -----------------------------------------------------------
    def check_health(self) -> None:
        """Raise RuntimeError (with the reason) if the engine can no longer run steps: a
        tensor-parallel worker died or failed. Cheap; for the server's /health."""
        reason = self.runner.dead_reason
        if reason is not None:
            raise RuntimeError(reason)

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - nothing to report to at collection time
            pass

    def shutdown(self) -> None:
        """Release the model: stops tensor-parallel workers, and drops the weights, KV
        cache and graphs held here (their memory goes back once collected). Safe to call
        more than once; the engine runs no more steps after it. A CUDA graph capture under
        way is cancelled first (its change is never made)."""
        change = getattr(self, "_live_change", None)
        if change is not None:
            self._live_change = None
            change.cancel()
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.close()
        spec_decoder = getattr(self, "spec_decoder", None)
        if spec_decoder is not None:
            spec_decoder.close()
        grammars = getattr(self, "grammars", None)
        if grammars is not None:
            grammars.close()
        pool = getattr(self, "_fill_ahead_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
            self._filled_ahead = None
        self.requests = {}
        self._in_flight = None
        self._pending_outputs = []
        self._awaiting_grammar = []
        for name in ("runner", "block_manager", "scheduler"):
            if hasattr(self, name):
                setattr(self, name, None)

    # -- observability -----------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        spec = self.spec_decoder.counters if self.spec_decoder is not None else None
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting)
            + sum(len(request.seqs) for request, _ in self._awaiting_grammar),
            kv_cache_usage=bm.usage,
            num_total_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            num_preemptions_total=self.scheduler.num_preemptions,
            prefix_cache_queries_total=bm.prefix_cache_queries,
            prefix_cache_hits_total=bm.prefix_cache_hits,
            prompt_tokens_total=self.output_processor.prompt_tokens_total,
            generation_tokens_total=self.output_processor.generation_tokens_total,
            spec_decode_num_drafts_total=spec.num_drafts if spec else 0,
            spec_decode_num_draft_tokens_total=spec.num_draft_tokens if spec else 0,
            spec_decode_num_accepted_tokens_total=spec.num_accepted_tokens if spec else 0,
            spec_decode_num_accepted_tokens_per_pos_total=(
                tuple(spec.accepted_per_position) if spec else ()),
            **lora_stats(self.scheduler, self.config.max_loras if self.config.enable_lora else 0),
        )


def _prompt_logprobs_requests(
    seqs: list[Sequence], counts: list[int], unscored: set[Sequence]
) -> list[PromptLogprobsRequest]:
    """What this step must score of each prompt: the positions it computes whose next token
    is a prompt token not asked for yet (chunk by chunk; never twice after a preemption).
    A sequence leaves ``unscored`` once every position has been asked for."""
    requests = []
    for row, (seq, count) in enumerate(zip(seqs, counts)):
        if seq not in unscored:
            continue
        computed = seq.num_computed_tokens
        start = max(computed, seq.num_prompt_logprob_positions)
        end = min(computed + count, seq.num_prompt_tokens - 1)
        if start >= end:
            continue
        requests.append(
            PromptLogprobsRequest(
                row=row, first=start - computed, num_positions=end - start,
                target_ids=seq.prompt_token_ids[start + 1 : end + 1],
                num_logprobs=seq.params.prompt_logprobs,
            )
        )  # fmt: skip
        seq.num_prompt_logprob_positions = end
        if end == seq.num_prompt_tokens - 1:
            unscored.discard(seq)
    return requests
