"""What the engine hands back: vLLM-shaped request and completion outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob, holding the sampled token and the
# requested number of most likely alternatives.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = field(default=None)


class OutputAccumulator:
    """Builds a request's cumulative output from the per-step deltas the engine process
    sends (new token ids, new text, new logprobs), in amortised O(new) per step; a
    cumulative ``RequestOutput`` is materialised only when asked for."""

    __slots__ = (
        "request_id", "prompt", "prompt_token_ids", "finished", "prompt_logprobs", "_completions",
    )  # fmt: skip

    def __init__(
        self, request_id: str, prompt: str | None = None, prompt_token_ids: list[int] | None = None
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids or []
        self.finished = False
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        # index -> [text pieces, token ids, logprobs or None, cumulative logprob, finish, stop]
        self._completions: dict[int, list] = {}

    def add(self, delta: RequestOutput) -> None:
        for c in delta.outputs:
            entry = self._completions.get(c.index)
            if entry is None:
                entry = self._completions[c.index] = [[], [], None, None, None, None]
            if c.text:
                entry[0].append(c.text)
            entry[1].extend(c.token_ids)
            if c.logprobs is not None:
                if entry[2] is None:
                    entry[2] = []
                entry[2].extend(c.logprobs)
            entry[3] = c.cumulative_logprob
            entry[4] = c.finish_reason
            entry[5] = c.stop_reason
        self.finished = self.finished or delta.finished
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs

    def output(self) -> RequestOutput:
        completions = []
        for index in sorted(self._completions):
            pieces, token_ids, logprobs, cumulative, finish, stop = self._completions[index]
            text = "".join(pieces)
            if len(pieces) > 1:
                pieces[:] = [text]
            completions.append(
                CompletionOutput(
                    index,
                    text,
                    list(token_ids),
                    cumulative,
                    list(logprobs) if logprobs is not None else None,
                    finish,
                    stop,
                )  # fmt: skip
            )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
        )
