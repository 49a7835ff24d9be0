"""From a completion's token ids to its text, in whichever process shapes the outputs.

vLLM V1 keeps detokenization out of the engine's step loop: the engine process returns
token ids and logprobs, and the API process turns them into text, finds stop strings and
shapes the outputs. Both of our fronts do it with the same code:

- ``CompletionText``: one completion's incremental detokenizer, its stop strings (vLLM's
  rules: a stop token's text joins the output only with ``include_stop_str_in_output``,
  a stop string completed by the first ``min_tokens`` tokens does not count, the text is
  cut at the stop string) and the hold-back of text a stop string could still claim. The
  in-process ``OutputProcessor`` (``LLM``, the engine when it makes its own text) uses it;
- ``TextOutputs``: the server's side. It takes each step's ``OutputRows`` from the engine
  process and gives every request its ``RequestOutput`` delta (text, decoded logprobs),
  and says which completions a stop string ended (``StopSequences`` for the engine, which
  keeps generating for them until it hears; the tokens past the stop are never shown).
  Finish reasons are counted here, where the final one is known.

Imports neither torch nor the engine: the server process runs it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from inference.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer
from inference.engine_messages import OutputRows
from inference.outputs import CompletionOutput, Logprob, RequestOutput
from inference.sampling_params import SamplingParams


def stop_token_ids(params: SamplingParams, eos_token_ids: Iterable[int]) -> frozenset[int]:
    """The tokens that end a completion (once ``min_tokens`` are out): EOS unless ignored,
    and ``stop_token_ids``."""
    eos = () if params.ignore_eos else eos_token_ids
    return frozenset(eos) | frozenset(params.stop_token_ids)


class CompletionText:
    """One completion's text as its tokens arrive."""

    __slots__ = (
        "detok", "stops", "include_stop", "min_tokens", "stop_tokens", "holdback",
        "num_sent_chars",
    )  # fmt: skip

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        stop_tokens: frozenset[int],
    ) -> None:
        self.detok = IncrementalDetokenizer(
            tokenizer, list(prompt_token_ids[-CONTEXT_TOKENS:]), params.skip_special_tokens
        )
        self.stops = list(params.stop or ())
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.stop_tokens = stop_tokens
        # Characters of text a stop string could still claim: held back while it runs.
        self.holdback = max(map(len, self.stops)) - 1 if self.stops and not self.include_stop else 0
        self.num_sent_chars = 0

    @property
    def text(self) -> str:
        return self.detok.text

    def add(self, token_id: int, num_output_tokens: int) -> str | None:
        """Take in the completion's newest token (its ``num_output_tokens``-th); return the
        stop string it completed (the text is cut there), or None."""
        if token_id in self.stop_tokens and num_output_tokens >= self.min_tokens:
            # The token ends the completion itself; its text only if asked for.
            if self.include_stop:
                self.detok.add(token_id)
            return None
        num_new_chars = len(self.detok.add(token_id))
        if self.stops and num_new_chars and num_output_tokens > self.min_tokens:
            return _truncate_at_stop(self.detok, self.stops, self.include_stop, num_new_chars)
        return None

    def take_new(self, finished: bool) -> str:
        """The text not handed out yet, less the hold-back while the completion runs."""
        text = self.detok.text
        end = len(text) if finished else len(text) - self.holdback
        sent = self.num_sent_chars
        if end <= sent:
            return ""
        self.num_sent_chars = end
        return text[sent:end]


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


class TokenTexts:
    """Each token id's own text (``Logprob.decoded_token``), decoded once."""

    __slots__ = ("tokenizer", "cache")

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text

    def entries(self, rows: list[dict[int, Logprob] | None]) -> list[dict[int, Logprob] | None]:
        """Logprob entries (per token: id -> Logprob) with their tokens' text filled in."""
        return [
            None if row is None
            else {tid: Logprob(lp.logprob, lp.rank, self(tid)) for tid, lp in row.items()}
            for row in rows
        ]  # fmt: skip


class _Completion:
    __slots__ = ("text", "num_tokens", "finished")

    def __init__(self) -> None:
        self.text: CompletionText | None = None
        self.num_tokens = 0
        self.finished = False


class _Request:
    __slots__ = (
        "params", "stop_tokens", "prompt_tail", "completions", "num_finished", "first_finish",
    )  # fmt: skip

    def __init__(self, params: SamplingParams, stop_tokens: frozenset[int]) -> None:
        self.params = params
        self.stop_tokens = stop_tokens
        self.prompt_tail: list[int] = []  # the prompt's last tokens: the detokenizer's context
        self.completions = [_Completion() for _ in range(params.n)]
        self.num_finished = 0
        self.first_finish: str | None = None  # completion 0's: the request's, for metrics


class TextOutputs:
    """The server's output processor: the engine's rows in, ``RequestOutput`` deltas out."""

    def __init__(self) -> None:
        self.tokenizer = None
        self.eos_token_ids: frozenset[int] = frozenset()
        self.token_texts = TokenTexts(None)
        self.requests: dict[str, _Request] = {}
        self.finished: dict[str, int] = {}  # finish reason -> requests, since last taken

    def set_tokenizer(self, tokenizer, eos_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.token_texts = TokenTexts(tokenizer)

    def add(self, request_id: str, params: SamplingParams) -> None:
        self.requests[request_id] = _Request(params, stop_token_ids(params, self.eos_token_ids))

    def remove(self, request_id: str, *, aborted: bool) -> None:
        """The request's stream is gone; ``aborted``: before it finished (counted so)."""
        if self.requests.pop(request_id, None) is not None and aborted:
            self._count("abort")

    def take_finished(self) -> dict[str, int]:
        counts, self.finished = self.finished, {}
        return counts

    def _count(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1

    def process(
        self, rows: OutputRows
    ) -> tuple[dict[str, RequestOutput], list[tuple[str, int, str]]]:
        """One step's rows: each request's delta output, and the (request id, completion
        index, stop string) of completions a stop string ended in this step."""
        outputs: dict[str, RequestOutput] = {}
        stops: list[tuple[str, int, str]] = []
        requests = self.requests
        token_texts = self.token_texts
        prompt_tails = rows.prompt_tails
        for request_id, index, token_ids, logprobs, cumulative, finish, stop_reason in zip(
            rows.request_ids, rows.indexes, rows.token_ids, rows.logprobs,
            rows.cumulative_logprobs, rows.finish_reasons, rows.stop_reasons,
        ):  # fmt: skip
            request = requests.get(request_id)
            if request is None:
                continue  # its stream is gone
            completion = request.completions[index]
            if completion.finished:
                continue  # a stop string ended it; the engine had not heard yet
            params = request.params
            tail = prompt_tails.get(request_id)
            if tail is not None:
                request.prompt_tail = tail
            text = completion.text
            if text is None and self.tokenizer is not None and params.detokenize:
                text = completion.text = CompletionText(
                    self.tokenizer, request.prompt_tail, params, request.stop_tokens
                )
            if text is not None:
                for position, token_id in enumerate(token_ids):
                    completion.num_tokens += 1
                    stop = text.add(token_id, completion.num_tokens)
                    if stop is not None:  # the rest of the row is past the stop
                        if logprobs is not None and cumulative is not None:
                            cumulative -= sum(
                                entry[tid].logprob
                                for tid, entry in zip(token_ids[position + 1 :],
                                                      logprobs[position + 1 :])
                            )  # fmt: skip
                            logprobs = logprobs[: position + 1]
                        token_ids = token_ids[: position + 1]
                        if finish is None:  # the engine generates on until it hears
                            stops.append((request_id, index, stop))
                        finish, stop_reason = "stop", stop
                        break
            else:
                completion.num_tokens += len(token_ids)
            if finish is not None:
                completion.finished = True
                request.num_finished += 1
                if index == 0:
                    request.first_finish = finish
            output = outputs.get(request_id)
            if output is None:
                output = outputs[request_id] = RequestOutput(request_id, None, [], [], False)
                prompt_logprobs = rows.prompt_logprobs.get(request_id)
                if prompt_logprobs is not None:
                    output.prompt_logprobs = token_texts.entries(prompt_logprobs)
            output.outputs.append(CompletionOutput(
                index,
                text.take_new(finish is not None) if text is not None else "",
                token_ids,
                cumulative,
                token_texts.entries(logprobs) if logprobs is not None else None,
                finish,
                stop_reason,
            ))  # fmt: skip
            if request.num_finished == len(request.completions):
                output.finished = True
                del requests[request_id]
                self._count(request.first_finish or "abort")
        return outputs, stops
