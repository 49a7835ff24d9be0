"""The step loop: schedule -> run -> sample -> update.

A request's life, top to bottom:
  ``add_request``  validates and tokenizes, creates ``n`` sequences, queues them;
  ``step``         the scheduler picks this step's tokens (``Scheduler.schedule``), the model
                   runner computes them and samples for sequences whose tokens are all
                   computed (``ModelRunner.launch``), then each new token is appended,
                   detokenized and checked against the stop conditions (``_process_token``);
                   finished sequences give their KV blocks back (``Scheduler.finish``);
                   a structured-output request first waits here, outside the scheduler,
                   until its grammar matcher is built (``inference.structured_output``);
  ``abort_request`` frees a request's blocks at any point.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from inference.block_manager import BlockManager, prefix_cache_root
from inference.config import EngineConfig
from inference.detokenizer import IncrementalDetokenizer
from inference.engine_messages import EngineStats
from inference.engine_setup import (
    check_capacity,
    check_tensor_parallel,
    eos_token_ids,
    make_runner,
    resolve_device,
    resolve_dtype,
)
from inference.executor.interface import ModelExecutor, PendingStep
from inference.layers.kv_cache import kv_cache_torch_dtype
from inference.model_files import load_tokenizer, resolve_model
from inference.models.config import ModelConfig
from inference.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from inference.sampler import (
    PromptLogprobs,
    PromptLogprobsRequest,
    RowLogprobs,
    SamplerOutput,
    SamplingMetadata,
    has_penalties,
)
from inference.sampling_params import SamplingParams
from inference.scheduler import Scheduler
from inference.sequence import Sequence, SequenceStatus
from inference.structured_output import GrammarCompiler

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
    _output: SamplerOutput | None = None
    _read: bool = False

    def result(self) -> SamplerOutput | None:
        """The step's sampled tokens (waits for the device once)."""
        if not self._read:
            self._output, self._read = self.handle.result(), True
        return self._output


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer | None]
    arrival_time: float
    prompt_logprobs_sent: bool = False  # delta outputs carry them once

    @property
    def finished(self) -> bool:
        # A loop, not all(genexpr): this runs for every request every step.
        for seq in self.seqs:
            if seq.status is not SequenceStatus.FINISHED:
                return False
        return True


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.model_path = resolve_model(config.model)
        self.model_name = config.served_model_name or self.model_path.name
        self.model_config = ModelConfig.from_folder(self.model_path)
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_path)
        if self.tokenizer is None:
            logger.warning("%s has no tokenizer files: prompts must be token ids", self.model_path)
        self.eos_token_ids = eos_token_ids(self.model_path, self.model_config, self.tokenizer)
        self.device = resolve_device(config)
        check_tensor_parallel(config, self.model_config, self.device)
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        self.config = config = config.resolve(self.model_config, self.device.type)
        torch.manual_seed(config.seed)

        # One GPU: the model runs in this process. Tensor parallel: worker processes hold
        # the shards; the executor offers the runner's methods.
        self.runner: ModelExecutor = make_runner(
            config, self.model_config, str(self.model_path), self.device, self.dtype
        )
        try:
            num_blocks = self._size_kv_cache()
        except BaseException:
            self.runner.close()
            raise
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching,
            prefix_cache_root(
                model=str(self.model_path), load_format=config.load_format,
                dtype=str(self.dtype), kv_cache_dtype=str(self.kv_cache_dtype),
                quantization=config.quantization,
            ),
        )  # fmt: skip
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens
        )
        self.requests: dict[str, _Request] = {}
        # Structured outputs: matchers are built off the step loop; requests wait here
        # until theirs is ready.
        self.grammars = GrammarCompiler(
            self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids)
        )
        self._awaiting_grammar: list[tuple[_Request, Future]] = []
        # Async scheduling (on by default): step n+1 is launched before step n's tokens
        # are read back. Off, each step completes before the next is scheduled.
        self.async_scheduling = config.async_scheduling
        self._in_flight: _LaunchedStep | None = None
        self._pending_outputs: list[RequestOutput] = []
        # Streaming callers want every step's progress; batch callers only final outputs.
        self.emit_unfinished_outputs = True
        # Delta outputs: each output carries only the token ids and logprobs produced since
        # the request's previous output (text stays cumulative), so a long stream does not
        # copy its whole history every step. The engine core (the server's engine) sets it.
        self.delta_outputs = False
        self._next_seq_id = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.computed_tokens_total = 0  # tokens run through the model (prefix hits excluded)
        # Sequences with prompt positions still to score (prompt_logprobs): steps look for
        # prompt-logprob work only while there are any.
        self._unscored: set[Sequence] = set()

    def _size_kv_cache(self) -> int:
        """Profile, allocate the KV cache and capture graphs; returns the block count."""
        config = self.config
        t0 = time.perf_counter()
        num_blocks = self.runner.determine_num_blocks()
        t1 = time.perf_counter()
        check_capacity(config, num_blocks)
        self.runner.allocate_kv_cache(num_blocks)
        t2 = time.perf_counter()
        capture_s = self.runner.capture_graphs()
        self.num_total_blocks = num_blocks
        self.startup_phases = {
            "load_s": round(self.runner.load_seconds, 2),
            "profile_s": round(t1 - t0, 2),
            "allocate_s": round(t2 - t1, 2),
            "capture_s": round(capture_s, 2),
        }
        logger.info("start-up by phase: %s", self.startup_phases)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %s, %.2f GiB%s); max concurrency at "
            "max_model_len=%d: %.1f", num_blocks, config.block_size,
            num_blocks * config.block_size, str(self.kv_cache_dtype).removeprefix("torch."),
            num_blocks * self.runner.bytes_per_block / 2**30,
            " per GPU" if config.tensor_parallel_size > 1 else "",
            config.max_model_len, num_blocks * config.block_size / config.max_model_len,
        )
        return num_blocks

    # -- intake ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request. Raises ValueError, changing nothing, on bad input."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = (params or SamplingParams()).clone()
        params.validate()
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
        eos = set() if params.ignore_eos else set(self.eos_token_ids)
        params.all_stop_token_ids = eos | set(params.stop_token_ids)

        arrival_time = time.time() if arrival_time is None else arrival_time
        seqs, detoks = [], []
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                # Tensor parallel: workers seed their own from (seq id, seed); the engine
                # process keeps off the GPU.
                on_host = self.config.tensor_parallel_size > 1
                generator = torch.Generator(device="cpu" if on_host else self.device)
                generator.manual_seed(params.seed + index)
            seq = Sequence(
                self._next_seq_id, request_id, index, prompt_ids, params, arrival_time, generator
            )
            self._next_seq_id += 1
            seqs.append(seq)
            detoks.append(
                IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
                if params.detokenize and self.tokenizer is not None
                else None
            )
        request = _Request(request_id, prompt_text, prompt_ids, params, seqs, detoks, arrival_time)
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
                del self.requests[request.request_id]
                self._pending_outputs.append(self._make_output(request))
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
                self._unscored.discard(seq)
                if not seq.is_finished:
                    self.scheduler.finish(seq)
                    seq.finish_reason = "abort"
            self._pending_outputs.append(self._make_output(request))

    # -- the loop ----------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending_outputs) or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        """One scheduling step. With async scheduling the step is launched first and the
        previous step's tokens are processed while the device runs it, so the host's work
        (stop checks, detokenization, outputs, the next schedule) hides behind the GPU's."""
        if self._awaiting_grammar:
            self._admit_grammar_requests()
        outputs, self._pending_outputs = self._pending_outputs, []
        batch = self.scheduler.schedule()
        launched = self._launch(batch) if batch else None
        previous, self._in_flight = self._in_flight, launched
        if previous is not None:
            self._complete(previous, outputs)
        if launched is not None and (not self.async_scheduling or launched.needs_sync):
            self._in_flight = None
            self._complete(launched, outputs)
        return outputs

    def _launch(self, batch) -> _LaunchedStep:
        now = time.time()
        seqs, counts = batch.seqs, batch.num_new_tokens
        self.computed_tokens_total += batch.num_batched_tokens
        # Rows whose last known token is computed this step get a new token sampled.
        sample_rows = [
            row for row, (s, n) in enumerate(zip(seqs, counts))
            if s.num_computed_tokens + n == s.num_tokens
        ]
        sampled_seqs = [seqs[row] for row in sample_rows]
        sampling = self._sampling_metadata(sampled_seqs)
        if self._unscored:
            sampling.prompt_logprobs = _prompt_logprobs_requests(seqs, counts, self._unscored)
        constrained = [row for row, s in enumerate(sampled_seqs) if s.grammar is not None]
        if constrained:
            # Filled once this step's forward pass is queued (``SamplingMetadata``), after
            # the step in flight's tokens have advanced the matchers.
            sampling.bitmask_rows = constrained
            sampling.fill_token_bitmask = partial(
                self._fill_bitmask, self._in_flight,
                [sampled_seqs[row].grammar for row in constrained],
            )  # fmt: skip
        handle = self.runner.launch(seqs, counts, sample_rows, sampling)
        prompt_logprobs = [(seqs[r.row], r) for r in sampling.prompt_logprobs]
        for seq, n in zip(seqs, counts):
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        # Each sampled sequence gets its coming token as a placeholder (-1 - row): the
        # next step can be scheduled and run before the host knows its value.
        positions = []
        for row, seq in enumerate(sampled_seqs):
            positions.append(seq.num_tokens)
            seq.append_placeholder(-1 - row)
        needs_sync = any(has_penalties(s.params) for s in sampled_seqs)
        return _LaunchedStep(
            handle, sampled_seqs, positions, needs_sync, prompt_logprobs, bool(constrained)
        )

    def _fill_bitmask(self, in_flight: _LaunchedStep | None, matchers: list) -> np.ndarray:
        if in_flight is not None:
            self._advance_grammars(in_flight)
        return self.grammars.fill_bitmask(matchers)

    def _advance_grammars(self, step: _LaunchedStep) -> None:
        """Feed a step's sampled tokens to its constrained sequences' matchers, once."""
        if step.grammar_ended is not None or not step.has_grammar:
            return
        step.grammar_ended = {}
        sampled = step.result()
        if sampled is None:
            return
        rows = [
            i for i, seq in enumerate(step.seqs) if seq.grammar is not None and not seq.is_finished
        ]
        if rows:
            ended = self.grammars.advance(
                [step.seqs[i].grammar for i in rows], [sampled.token_ids[i] for i in rows]
            )
            step.grammar_ended = dict(zip(rows, ended))

    def _complete(self, step: _LaunchedStep, outputs: list[RequestOutput]) -> None:
        """Put a launched step's sampled tokens in place of their placeholders, then check
        each sequence's stop conditions and emit outputs."""
        sampled = step.result()
        if sampled is None:
            return
        self._advance_grammars(step)
        grammar_ended = step.grammar_ended or {}
        for (seq, asked), result in zip(step.prompt_logprobs, sampled.prompt_logprobs, strict=True):
            if not seq.is_finished:  # not aborted meanwhile
                seq.prompt_logprobs.extend(self._prompt_logprob_dicts(asked.target_ids, result))
        touched: dict[str, _Request] = {}
        now = time.time()
        for i, (seq, position) in enumerate(zip(step.seqs, step.positions)):
            if seq.is_finished:
                continue  # aborted, or stopped by an earlier token while this step ran
            request = self.requests[seq.request_id]
            token_id = sampled.token_ids[i]
            seq.resolve_placeholder(position, token_id)
            self.block_manager.cache_full_blocks(seq)
            self._process_token(
                request, seq, token_id, sampled.logprobs[i], now, grammar_ended.get(i, False)
            )
            touched[request.request_id] = request
        for request in touched.values():
            finished = request.finished
            if finished or self.emit_unfinished_outputs:
                outputs.append(self._make_output(request, finished))
            if finished:
                del self.requests[request.request_id]

    def _sampling_metadata(self, seqs: list[Sequence]) -> SamplingMetadata:
        # Token histories only for rows whose sampling reads them (penalties, min_tokens):
        # copying every sequence's tokens every step would cost more than the step.
        prompts, outputs, counts = [], [], []
        for seq in seqs:
            p = seq.params
            penalized = (
                p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
            )
            # Pending placeholders count towards min_tokens; penalised rows have none (their
            # steps complete before the next is scheduled).
            counts.append(seq.num_tokens - seq.num_prompt_tokens)
            prompts.append(seq.prompt_token_ids if p.repetition_penalty != 1.0 else [])
            outputs.append(seq.output_token_ids if penalized else [])
        return SamplingMetadata(
            params=[s.params for s in seqs],
            prompt_token_ids=prompts,
            output_token_ids=outputs,
            num_output_tokens=counts,
            generators=[s.generator for s in seqs],
        )

    def _process_token(
        self,
        request: _Request,
        seq: Sequence,
        token_id: int,
        row_logprobs: RowLogprobs | None,
        now: float,
        grammar_ended: bool = False,
    ) -> None:
        self.generation_tokens_total += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
            if seq.index == 0:
                self.prompt_tokens_total += seq.num_prompt_tokens
        seq.last_token_time = now
        if row_logprobs is not None:
            seq.logprobs.append(self._logprob_dict(token_id, row_logprobs))
            seq.cumulative_logprob += row_logprobs.sampled_logprob
        detok = request.detokenizers[seq.index]
        p = seq.params
        # EOS (unless ignored) and stop_token_ids end the request once min_tokens are out
        # (the sampler forbids them before); as in vLLM, the token stays in token_ids but
        # its text joins the output only with include_stop_str_in_output.
        stop_token = token_id in p.all_stop_token_ids and seq.num_output_tokens >= p.min_tokens
        num_new_chars = 0
        if detok is not None and (not stop_token or p.include_stop_str_in_output):
            num_new_chars = len(detok.add(token_id))
        finish, reason = self._check_stop(seq, token_id, stop_token, detok, num_new_chars)
        if grammar_ended and finish is None:
            finish, reason = "stop", None
        if finish is not None:
            seq.finish_reason, seq.stop_reason = finish, reason
            self.scheduler.finish(seq)

    def _check_stop(
        self, seq: Sequence, token_id: int, stop_token: bool, detok, num_new_chars: int
    ):
        p = seq.params
        num_out = seq.num_output_tokens
        if stop_token:
            is_eos = token_id in self.eos_token_ids and not p.ignore_eos
            return "stop", None if is_eos else token_id
        # vLLM ignores stop strings completed by the first min_tokens tokens.
        if p.stop and detok is not None and num_new_chars and num_out > p.min_tokens:
            stop_str = _truncate_at_stop(
                detok, p.stop, p.include_stop_str_in_output, num_new_chars
            )
            if stop_str is not None:
                return "stop", stop_str
        if num_out >= p.max_tokens or seq.num_known_tokens >= self.config.max_model_len:
            return "length", None
        return None, None

    def _logprob_dict(self, token_id: int, row: RowLogprobs) -> dict[int, Logprob]:
        entry = {
            tid: Logprob(lp, rank + 1, self._decode_one(tid))
            for rank, (tid, lp) in enumerate(zip(row.top_token_ids, row.top_logprobs))
        }
        if token_id not in entry:
            entry[token_id] = Logprob(
                row.sampled_logprob, row.sampled_rank, self._decode_one(token_id)
            )
        return entry

    def _prompt_logprob_dicts(
        self, target_ids: list[int], result: PromptLogprobs
    ) -> list[dict[int, Logprob]]:
        """vLLM's shape: per prompt token, the prompt token and the top-k alternatives."""
        dicts = []
        decode = self._decode_one
        for token_id, logprob, rank, top_ids, top_logprobs in zip(
            target_ids, result.token_logprobs, result.ranks,
            result.top_token_ids, result.top_logprobs, strict=True,
        ):  # fmt: skip
            entry = {
                tid: Logprob(lp, i + 1, decode(tid))
                for i, (tid, lp) in enumerate(zip(top_ids, top_logprobs))
            }
            if token_id not in entry:
                entry[token_id] = Logprob(logprob, rank, decode(token_id))
            dicts.append(entry)
        return dicts

    def _decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _make_output(self, request: _Request, finished: bool | None = None) -> RequestOutput:
        wants_logprobs = request.params.logprobs is not None
        delta = self.delta_outputs
        completions = []
        for seq, detok in zip(request.seqs, request.detokenizers):
            known = seq.num_output_tokens
            start = seq.num_emitted_tokens if delta else 0
            if delta:
                seq.num_emitted_tokens = known
            offset = seq.num_prompt_tokens
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=detok.text if detok is not None else "",
                    token_ids=seq.token_ids[offset + start : offset + known],
                    cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
                    logprobs=seq.logprobs[start:known] if wants_logprobs else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        first = request.seqs[0]
        if finished is None:
            finished = request.finished
        last_token_time = first.last_token_time
        for seq in request.seqs[1:]:
            if seq.last_token_time is not None and (
                last_token_time is None or seq.last_token_time > last_token_time
            ):
                last_token_time = seq.last_token_time
        metrics = RequestMetrics(
            arrival_time=request.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=first.first_token_time,
            last_token_time=last_token_time,
            finished_time=time.time() if finished else None,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=metrics,
            num_cached_tokens=first.num_cached_tokens,
            prompt_logprobs=self._ready_prompt_logprobs(request),
        )

    def _ready_prompt_logprobs(self, request: _Request) -> list[dict[int, Logprob] | None] | None:
        """The prompt logprobs once every prompt token has its entry; delta outputs carry
        them once (with the first token, as vLLM sends them)."""
        prompt_logprobs = request.seqs[0].prompt_logprobs
        if prompt_logprobs is None or len(prompt_logprobs) < len(request.prompt_token_ids):
            return None
        if self.delta_outputs:
            if request.prompt_logprobs_sent:
                return None
            request.prompt_logprobs_sent = True
        return prompt_logprobs

    # -- lifecycle and health -----------------------------------------------------------
    def check_health(self) -> None:
        """Raise RuntimeError (with the reason) if the engine can no longer run steps: a
        tensor-parallel worker died or failed. Cheap; for the server's /health."""
        reason = self.runner.dead_reason
        if reason is not None:
            raise RuntimeError(reason)

    def shutdown(self) -> None:
        """Release the model: stops tensor-parallel workers (no-op on one GPU). Safe to
        call more than once."""
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.close()
        grammars = getattr(self, "grammars", None)
        if grammars is not None:
            grammars.close()

    # -- observability -----------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
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
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
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


def _truncate_at_stop(
    detok: IncrementalDetokenizer, stops: list[str], include: bool, num_new_chars: int
) -> str | None:
    """If a stop string ends within the newest ``num_new_chars`` characters of the text, cut
    the text there and return the string (vLLM's rule). The search starts ``len(stop) - 1``
    characters before the new text, so a stop string straddling tokens is found, and it
    covers all of the new text, however long one token's text is. Of several, the one that
    ends first wins (ties: list order): what reading the text a character at a time finds."""
    text = detok.text
    first_new = len(text) - num_new_chars
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, max(0, first_new - len(stop) + 1))
        if idx != -1 and (best is None or idx + len(stop) < best[0] + len(best[1])):
            best = (idx, stop)
    if best is None:
        return None
    idx, stop = best
    detok.text = text[: idx + len(stop)] if include else text[:idx]
    return stop
