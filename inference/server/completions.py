"""POST /v1/completions: text or token-id prompts, one or many, streamed or not.

``echo`` with ``logprobs`` puts the prompt's own tokens, with their logprobs (the first
one has none), before the completion's, as vLLM and OpenAI's legacy API do; with
``max_tokens: 0`` the response is the prompt alone: prompt scoring, as lm-eval-harness's
local-completions asks for it. Text offsets count from the start of the choice's text,
echoed prompt included, streamed or not.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request
from starlette.responses import Response

from inference.outputs import CompletionOutput, Logprob, RequestOutput
from inference.server.errors import APIError, error_body
from inference.server.protocol import CompletionRequest
from inference.server.serving import (
    ClientDisconnected,
    OpenAIServing,
    PreparedPrompt,
    clamp_logprob,
    collect,
    engine_error,
    top_logprobs,
    until_disconnected,
    usage,
    usage_counts,
)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "data: [DONE]\n\n"

# For strings, JSONEncoder.encode goes straight to the C escaper: the per-token cost of a
# chunk is this call plus string concatenation, with no dict or model built per token.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
dumps = _ENCODER.encode
_NULLS = ',"logprobs":null,"finish_reason":null,"stop_reason":null}'


def chunk_payload(view: Any, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """One streamed chunk's envelope; ``usage`` is null on every chunk but the last when
    the client asked for it (OpenAI's ``stream_options.include_usage``)."""
    payload: dict[str, Any] = {
        "id": view.request_id,
        "object": object_name,
        "created": view.created,
        "model": view.model,
        "choices": choices,
    }
    if view.include_usage:
        payload["usage"] = None
    return payload


class ChunkEnvelope:
    """``chunk_payload`` pre-serialised around its choices: a step's chunk is the head,
    the choices' JSON fragments and the tail, byte for byte what ``sse(chunk_payload(...))``
    gives."""

    __slots__ = ("head", "tail")

    def __init__(self, view: Any, object_name: str) -> None:
        envelope = dumps(chunk_payload(view, object_name, []))
        usage = ',"usage":null' if view.include_usage else ""
        self.head = "data: " + envelope.removesuffix('"choices":[]' + usage + "}") + '"choices":['
        self.tail = "]" + usage + "}\n\n"

    def render(self, choices: list[str], usage: dict[str, int] | None = None) -> str:
        """The chunk; with ``usage`` (``stream_options.continuous_usage_stats``) it carries
        the counts so far instead of null."""
        tail = self.tail if usage is None else f'],"usage":{dumps(usage)}}}\n\n'
        return self.head + ",".join(choices) + tail


def continuous_usage(req: Any) -> bool:
    """vLLM's ``continuous_usage_stats``: usage on every chunk (with ``include_usage``)."""
    options = req.stream_options
    return bool(options and options.include_usage and options.continuous_usage_stats)


def choice_end(logprobs: dict[str, Any] | None, finish_reason: str | None, stop_reason) -> str:
    """A streamed choice's last three fields and closing brace."""
    if logprobs is None and finish_reason is None and stop_reason is None:
        return _NULLS
    return (
        f',"logprobs":{dumps(logprobs)},"finish_reason":{dumps(finish_reason)},'
        f'"stop_reason":{dumps(stop_reason)}}}'
    )


def sse(payload: dict[str, Any]) -> str:
    return f"data: {dumps(payload)}\n\n"


class CompletionServing(OpenAIServing):
    def raw_prompts(self, req: CompletionRequest) -> list[str | list[int]]:
        prompt = req.prompt
        if isinstance(prompt, str):
            raw_prompts: list[str | list[int]] = [prompt]
        elif prompt and isinstance(prompt[0], int):
            raw_prompts = [prompt]  # type: ignore[list-item]
        else:
            raw_prompts = list(prompt)  # type: ignore[arg-type]
        if not raw_prompts:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return raw_prompts

    def prepare_prompts(self, raw_prompts: list[str | list[int]]) -> list[PreparedPrompt]:
        prepared = []
        for item in raw_prompts:
            if isinstance(item, str):
                prepared.append(PreparedPrompt(item, self.encode(item)))
            else:
                self.check_token_ids(item, "prompt")
                prepared.append(PreparedPrompt(None, list(item)))
        return prepared

    def validate(self, req: CompletionRequest) -> None:
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of different from n is not supported", param="best_of")
        if req.max_tokens == 0 and not req.echo:
            raise APIError(
                400, "max_tokens must be at least 1, or 0 together with echo (prompt scoring)",
                param="max_tokens",
            )  # fmt: skip

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        lora = self.check_model(req.model)
        self.check_ready()
        self.validate(req)
        raw_prompts = self.raw_prompts(req)
        self.check_batch(len(raw_prompts), req.n)
        prompts = await self.tokenizer_pool.run(raw, self.prepare_prompts, raw_prompts)
        # Prompt scoring still samples one token (the engine always does); it is not shown.
        wanted = 1 if req.max_tokens == 0 else req.max_tokens
        max_tokens = min(self.resolve_max_tokens(len(p.token_ids), wanted) for p in prompts)
        params = self.sampling_params(req, max_tokens, req.logprobs)
        if req.echo and req.logprobs is not None:
            params = replace(params, prompt_logprobs=req.logprobs)
        request_id = self.new_request_id("cmpl", raw)
        stream = self.generate(prompts, params, request_id, lora)
        try:
            first = await self.first_output(raw, stream)
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as exc:
            raise engine_error(exc) or exc from exc
        view = _CompletionView(self, req, prompts, request_id)
        if req.stream:
            return StreamingResponse(
                view.stream(first, stream), media_type="text/event-stream", headers=SSE_HEADERS
            )
        try:
            finals = await until_disconnected(raw, collect(first, stream))
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as exc:
            raise engine_error(exc) or exc from exc
        return JSONResponse(view.full_response(finals))


class _CompletionView:
    """Renders one completion request's outputs as OpenAI JSON and SSE chunks."""

    def __init__(
        self,
        serving: CompletionServing,
        req: CompletionRequest,
        prompts: list[PreparedPrompt],
        request_id: str,
    ) -> None:
        self.serving = serving
        self.req = req
        self.prompts = prompts
        self.request_id = request_id
        self.created = int(time.time())
        # An adapter's requests answer under its name, as vLLM's do.
        self.model = req.model if serving.adapters.get(req.model) else serving.model_name
        self.echo = bool(req.echo)
        self.prompt_only = self.echo and req.max_tokens == 0  # prompt scoring
        # Per prompt: its logprobs, which the engine sends once (streaming needs them for
        # every choice's first chunk).
        self.prompt_logprobs: dict[int, list[dict[int, Logprob] | None]] = {}

    def prompt_text(self, prompt_index: int) -> str:
        prompt = self.prompts[prompt_index]
        if prompt.text is not None:
            return prompt.text
        return self.serving.tokenizer.decode(prompt.token_ids)

    def logprobs_payload(
        self, token_ids: list[int], entries: list[dict[int, Logprob] | None], text_offset: int
    ) -> dict[str, list]:
        """OpenAI's logprobs object for these tokens; a token without an entry (a prompt's
        first) gets null logprobs, as in vLLM."""
        limit = max(self.req.logprobs or 0, 1)
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries, strict=False):
            chosen = entry.get(token_id) if entry is not None else None
            text = self.serving.token_text(token_id, chosen)
            tokens.append(text)
            token_logprobs.append(clamp_logprob(chosen.logprob) if chosen else None)
            tops.append(
                None if entry is None else {
                    self.serving.token_text(tid, lp): clamp_logprob(lp.logprob)
                    for tid, lp in top_logprobs(entry, limit)
                }
            )  # fmt: skip
            offsets.append(text_offset)
            text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def logprobs(
        self, prompt_index: int, completion: CompletionOutput, text_offset: int, echoed: bool
    ) -> dict[str, Any] | None:
        """The choice's logprobs: the echoed prompt's tokens first when ``echoed`` (this
        output carries the echo), then the completion's from ``text_offset``."""
        if self.req.logprobs is None:
            return None
        payload: dict[str, list] = {
            "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []
        }  # fmt: skip
        parts = []
        if echoed:
            prompt_ids = self.prompts[prompt_index].token_ids
            entries = self.prompt_logprobs.get(prompt_index) or [None] * len(prompt_ids)
            parts.append(self.logprobs_payload(prompt_ids, entries, 0))
        if not self.prompt_only and completion.logprobs is not None:
            parts.append(
                self.logprobs_payload(completion.token_ids, completion.logprobs, text_offset)
            )
        if not parts:
            return None
        for part in parts:
            for key, values in part.items():
                payload[key].extend(values)
        return payload

    def remember_prompt_logprobs(self, prompt_index: int, output: RequestOutput) -> None:
        if output.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = output.prompt_logprobs

    def full_response(self, finals: dict[int, RequestOutput]) -> dict[str, Any]:
        choices = []
        for prompt_index in sorted(finals):
            output = finals[prompt_index]
            self.remember_prompt_logprobs(prompt_index, output)
            prefix = self.prompt_text(prompt_index) if self.echo else ""
            for completion in output.outputs:
                text = prefix if self.prompt_only else prefix + completion.text
                choices.append(
                    {
                        "index": prompt_index * self.req.n + completion.index,
                        "text": text,
                        "logprobs": self.logprobs(prompt_index, completion, len(prefix), self.echo),
                        "finish_reason": completion.finish_reason,
                        "stop_reason": completion.stop_reason,
                    }
                )
        if self.prompt_only:
            counts = usage_counts(self.prompts, 0)  # the sampled token is not returned
        else:
            counts = usage(self.prompts, finals)
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": counts,
        }

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return chunk_payload(self, "text_completion", choices)

    @property
    def include_usage(self) -> bool:
        options = self.req.stream_options
        return bool(options and options.include_usage)

    async def stream(
        self,
        first: tuple[int, RequestOutput],
        rest: AsyncIterator[tuple[int, RequestOutput]],
    ) -> AsyncIterator[str]:
        """One chunk per engine step that produced something, from the engine's deltas."""
        envelope = ChunkEnvelope(self, "text_completion")
        sent_chars: dict[int, int] = {}
        num_tokens = 0
        continuous = continuous_usage(self.req)
        try:
            pending: tuple[int, RequestOutput] | None = first
            while pending is not None:
                prompt_index, output = pending
                choices = self._delta_choices(prompt_index, output, sent_chars)
                if not self.prompt_only:
                    for completion in output.outputs:
                        num_tokens += len(completion.token_ids)
                if choices:
                    counts = usage_counts(self.prompts, num_tokens) if continuous else None
                    yield envelope.render(choices, counts)
                pending = await anext(rest, None)
        except Exception as exc:
            error = engine_error(exc) or APIError(500, f"internal error: {type(exc).__name__}")
            yield sse(error_body(error.status, error.message, error.param, error.code))
        finally:
            await rest.aclose()  # type: ignore[attr-defined]
        if self.include_usage:
            payload = self.chunk([])
            payload["usage"] = usage_counts(self.prompts, num_tokens)
            yield sse(payload)
        yield DONE

    def _delta_choices(
        self, prompt_index: int, output: RequestOutput, sent_chars: dict[int, int]
    ) -> list[str]:
        # The engine sends a completion only when it has new tokens, new text or its finish
        # reason: a token that adds no text yet (half a UTF-8 character) still gets its
        # chunk, as in vLLM: clients count tokens by chunks. ``sent_chars`` counts each
        # choice's characters sent so far, echoed prompt included: the text offsets' origin.
        self.remember_prompt_logprobs(prompt_index, output)
        choices = []
        n = self.req.n
        for completion in output.outputs:
            index = prompt_index * n + completion.index
            start_chars = sent_chars.get(index)
            echoed = start_chars is None and self.echo
            text = "" if self.prompt_only else completion.text
            if start_chars is None:
                start_chars = 0
                if echoed:
                    prompt_text = self.prompt_text(prompt_index)
                    start_chars = len(prompt_text)
                    text = prompt_text + text
            elif self.prompt_only and completion.finish_reason is None:
                continue  # nothing of the sampled token is shown
            sent_chars[index] = start_chars + (0 if self.prompt_only else len(completion.text))
            logprobs = self.logprobs(prompt_index, completion, start_chars, echoed)
            choices.append(
                f'{{"index":{index},"text":{dumps(text)}'
                + choice_end(logprobs, completion.finish_reason, completion.stop_reason)
            )
        return choices
