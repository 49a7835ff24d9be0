"""From sampled tokens to ``RequestOutput``s (vLLM V1's ``OutputProcessor``).

What a new token means for its request is decided here, next to the detokenizer that needs
it: its text (incremental detokenization), its logprobs, and whether it ends the sequence.
The stop conditions are checked in one place so their precedence stays vLLM's: a stop token
(EOS, ``stop_token_ids``), then a stop string (found in the text, which it cuts), then
``max_tokens`` or ``max_model_len``, then the grammar's end. The processor says which
sequences stopped; the engine hands them back to the scheduler.

Each request's outputs are shaped by its ``SamplingParams.output_kind``, chosen when the
request is made rather than by flags on the engine:
  CUMULATIVE  every output holds everything so far (the default);
  DELTA       only what is new since the request's previous output: token ids, logprobs,
              text, and the prompt logprobs once (with the first token); a completion with
              nothing new is left out. Text that may be the start of a stop string is held
              back (the longest stop string minus one character) until its completion
              finishes, so text a client was sent is never cut back by a stop string found
              later. The engine process streams these to the server;
  FINAL_ONLY  one output, when the request finishes (``LLM.generate``).

The text itself (detokenization, stop strings, hold-back) is ``CompletionText``'s
(``inference/text_output.py``), shared with the server. Behind the server the engine makes
no text at all (``text=False``): token ids and logprobs only, the server's ``TextOutputs``
does the rest and tells the engine which completions a stop string ended
(``stop_sequences``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from inference.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from inference.sampler import PromptLogprobs, RowLogprobs
from inference.sampling_params import RequestOutputKind, SamplingParams
from inference.sequence import Sequence, SequenceStatus
from inference.text_output import CompletionText


@dataclass(eq=False)
class RequestState:
    """One request: its sequences (``n``), their text (None: no text is made), and what its
    outputs have carried so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    texts: list[CompletionText | None]
    arrival_time: float
    # DELTA outputs: per completion, the output tokens sent so far and whether its finish
    # was; the prompt logprobs go out once.
    num_sent_tokens: list[int] = field(init=False)
    sent_finish: list[bool] = field(init=False)
    prompt_logprobs_sent: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        n = len(self.seqs)
        self.num_sent_tokens = [0] * n
        self.sent_finish = [False] * n

    @property
    def finished(self) -> bool:
        # A loop, not all(genexpr): this runs for every request every step.
        for seq in self.seqs:
            if seq.status is not SequenceStatus.FINISHED:
                return False
        return True


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.text = True  # False: token ids and logprobs only (the server makes the text)
        self.prompt_tokens_total = 0  # of requests whose first token is out
        self.generation_tokens_total = 0

    def new_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seqs: list[Sequence],
        arrival_time: float,
    ) -> RequestState:
        detokenize = self.text and params.detokenize and self.tokenizer is not None
        texts = [
            CompletionText(self.tokenizer, prompt_token_ids, params, params.all_stop_token_ids)
            if detokenize
            else None
            for _ in seqs
        ]  # fmt: skip
        return RequestState(request_id, prompt, prompt_token_ids, params, seqs, texts, arrival_time)

    # -- tokens --------------------------------------------------------------------------
    def process_token(
        self,
        request: RequestState,
        seq: Sequence,
        token_id: int,
        row_logprobs: RowLogprobs | None,
        now: float,
        grammar_ended: bool = False,
    ) -> bool:
        """Take in ``seq``'s new token (already in its ``token_ids``): timings, logprobs,
        text, stop conditions. ``grammar_ended``: the token completed the sequence's
        structured output (its matcher has consumed it). Returns True if the token ends
        the sequence (its ``finish_reason`` and ``stop_reason`` are set)."""
        self.generation_tokens_total += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
            if seq.index == 0:
                self.prompt_tokens_total += seq.num_prompt_tokens
        seq.last_token_time = now
        if row_logprobs is not None:
            seq.logprobs.append(self._logprob_dict(token_id, row_logprobs))
            seq.cumulative_logprob += row_logprobs.sampled_logprob
        text = request.texts[seq.index]
        p = seq.params
        # EOS (unless ignored) and stop_token_ids end the request once min_tokens are out
        # (the sampler forbids them before); as in vLLM, the token stays in token_ids but
        # its text joins the output only with include_stop_str_in_output.
        num_out = seq.num_output_tokens
        stop_token = token_id in p.all_stop_token_ids and num_out >= p.min_tokens
        stop_str = text.add(token_id, num_out) if text is not None else None
        finish, reason = self._check_stop(seq, token_id, stop_token, stop_str)
        if grammar_ended and finish is None:
            finish, reason = "stop", None
        if finish is None:
            return False
        seq.finish_reason, seq.stop_reason = finish, reason
        return True

    def _check_stop(self, seq: Sequence, token_id: int, stop_token: bool, stop_str: str | None):
        p = seq.params
        if stop_token:
            is_eos = token_id in self.eos_token_ids and not p.ignore_eos
            return "stop", None if is_eos else token_id
        if stop_str is not None:
            return "stop", stop_str
        if seq.num_output_tokens >= p.max_tokens or seq.num_known_tokens >= self.max_model_len:
            return "length", None
        return None, None

    # -- logprobs ------------------------------------------------------------------------
    def add_prompt_logprobs(
        self, seq: Sequence, target_ids: list[int], result: PromptLogprobs
    ) -> None:
        """vLLM's shape: per prompt token, the prompt token and the top-k alternatives."""
        if seq.is_finished:
            return  # aborted while the step ran
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
            seq.prompt_logprobs.append(entry)

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

    def _decode_one(self, token_id: int) -> str | None:
        if self.tokenizer is None or not self.text:
            return None
        return self.tokenizer.decode([token_id])

    # -- outputs -------------------------------------------------------------------------
    def make_output(self, request: RequestState) -> RequestOutput | None:
        """The request's output now, as its ``output_kind`` wants it; None while a
        FINAL_ONLY request runs. A finished request always gets one."""
        kind = request.params.output_kind
        finished = request.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        wants_logprobs = request.params.logprobs is not None
        completions = []
        for i, (seq, completion_text) in enumerate(zip(request.seqs, request.texts)):
            known = seq.num_output_tokens
            text = completion_text.text if completion_text is not None else ""
            start = 0
            if delta:
                if request.sent_finish[i]:
                    continue
                start = request.num_sent_tokens[i]
                request.num_sent_tokens[i] = known
                text = (
                    completion_text.take_new(seq.finish_reason is not None)
                    if completion_text is not None else ""
                )  # fmt: skip
                if start == known and not text and seq.finish_reason is None:
                    continue
                request.sent_finish[i] = seq.finish_reason is not None
            offset = seq.num_prompt_tokens
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=seq.token_ids[offset + start : offset + known],
                    cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
                    logprobs=seq.logprobs[start:known] if wants_logprobs else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        first = request.seqs[0]
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
            prompt_logprobs=_ready_prompt_logprobs(request, delta),
        )


def _ready_prompt_logprobs(
    request: RequestState, delta: bool
) -> list[dict[int, Logprob] | None] | None:
    """The prompt logprobs once every prompt token has its entry; delta outputs carry
    them once (with the first token, as vLLM sends them)."""
    prompt_logprobs = request.seqs[0].prompt_logprobs
    if prompt_logprobs is None or len(prompt_logprobs) < len(request.prompt_token_ids):
        return None
    if delta:
        if request.prompt_logprobs_sent:
            return None
        request.prompt_logprobs_sent = True
    return prompt_logprobs
