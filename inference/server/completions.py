"""POST /v1/completions: text or token-id prompts, one or many, streamed or not."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request
from starlette.responses import Response

from inference.outputs import CompletionOutput, RequestOutput
from inference.server.errors import APIError, error_body
from inference.server.protocol import CompletionRequest
from inference.server.serving import (
    ClientDisconnected,
    OpenAIServing,
    PreparedPrompt,
    clamp_logprob,
    engine_error,
    token_text,
    top_logprobs,
    until_disconnected,
    usage,
)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def stop_holdback(stop: str | list[str] | None, include_stop: bool) -> int:
    """Characters to hold back while streaming: a stop string may be arriving a token at a
    time, and its first characters must not reach the client before the engine cuts them."""
    if not stop or include_stop:
        return 0
    stops = [stop] if isinstance(stop, str) else stop
    return max((len(s) for s in stops), default=1) - 1


def stream_end(completion: CompletionOutput, holdback: int) -> int:
    """How much of the completion's text may be streamed now."""
    if completion.finish_reason is not None or holdback == 0:
        return len(completion.text)
    return max(0, len(completion.text) - holdback)


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


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


class CompletionServing(OpenAIServing):
    def prepare_prompts(self, req: CompletionRequest) -> list[PreparedPrompt]:
        prompt = req.prompt
        if isinstance(prompt, str):
            raw_prompts: list[str | list[int]] = [prompt]
        elif prompt and isinstance(prompt[0], int):
            raw_prompts = [prompt]  # type: ignore[list-item]
        else:
            raw_prompts = list(prompt)  # type: ignore[arg-type]
        if not raw_prompts:
            raise APIError(400, "prompt must not be empty", param="prompt")
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

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        self.check_ready()
        self.validate(req)
        prompts = self.prepare_prompts(req)
        max_tokens = min(self.resolve_max_tokens(len(p.token_ids), req.max_tokens) for p in prompts)
        params = self.sampling_params(req, max_tokens, req.logprobs)
        request_id = self.new_request_id("cmpl")
        stream = self.generate(prompts, params, request_id)
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
            finals = await until_disconnected(raw, _collect(first, stream))
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as exc:
            raise engine_error(exc) or exc from exc
        return JSONResponse(view.full_response(finals))


async def _collect(
    first: tuple[int, RequestOutput], stream: AsyncIterator[tuple[int, RequestOutput]]
) -> dict[int, RequestOutput]:
    finals = {first[0]: first[1]}
    async for index, output in stream:
        finals[index] = output
    return finals


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
        self.model = serving.model_name
        self.holdback = stop_holdback(req.stop, req.include_stop_str_in_output)

    def prompt_text(self, prompt_index: int) -> str:
        prompt = self.prompts[prompt_index]
        if prompt.text is not None:
            return prompt.text
        return self.serving.tokenizer.decode(prompt.token_ids)

    def logprobs(
        self, completion: CompletionOutput, start: int, text_offset: int
    ) -> dict[str, Any] | None:
        if self.req.logprobs is None or completion.logprobs is None:
            return None
        tokenizer = self.serving.tokenizer
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, entry in zip(
            completion.token_ids[start:], completion.logprobs[start:], strict=False
        ):
            sampled = entry.get(token_id)
            text = token_text(tokenizer, token_id, sampled)
            tokens.append(text)
            token_logprobs.append(clamp_logprob(sampled.logprob) if sampled else None)
            tops.append(
                {
                    token_text(tokenizer, tid, lp): clamp_logprob(lp.logprob)
                    for tid, lp in top_logprobs(entry, max(self.req.logprobs, 1))
                }
            )
            offsets.append(text_offset)
            text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def full_response(self, finals: dict[int, RequestOutput]) -> dict[str, Any]:
        choices = []
        for prompt_index in sorted(finals):
            output = finals[prompt_index]
            prefix = self.prompt_text(prompt_index) if self.req.echo else ""
            for completion in output.outputs:
                choices.append(
                    {
                        "index": prompt_index * self.req.n + completion.index,
                        "text": prefix + completion.text,
                        "logprobs": self.logprobs(completion, 0, len(prefix)),
                        "finish_reason": completion.finish_reason,
                        "stop_reason": completion.stop_reason,
                    }
                )
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(self.prompts, finals),
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
        sent_chars: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        finals: dict[int, RequestOutput] = {}
        finished: set[int] = set()
        try:
            pending: tuple[int, RequestOutput] | None = first
            while pending is not None:
                prompt_index, output = pending
                finals[prompt_index] = output
                choices = self._delta_choices(
                    prompt_index, output, sent_chars, sent_tokens, finished
                )
                if choices:
                    yield sse(self.chunk(choices))
                pending = await anext(rest, None)
        except Exception as exc:
            error = engine_error(exc) or APIError(500, f"internal error: {type(exc).__name__}")
            yield sse(error_body(error.status, error.message, error.param, error.code))
        finally:
            await rest.aclose()  # type: ignore[attr-defined]
        if self.include_usage:
            payload = self.chunk([])
            payload["usage"] = usage(self.prompts, finals)
            yield sse(payload)
        yield "data: [DONE]\n\n"

    def _delta_choices(
        self,
        prompt_index: int,
        output: RequestOutput,
        sent_chars: dict[int, int],
        sent_tokens: dict[int, int],
        finished: set[int],
    ) -> list[dict[str, Any]]:
        choices = []
        for completion in output.outputs:
            index = prompt_index * self.req.n + completion.index
            if index in finished:
                continue
            first_chunk = index not in sent_tokens
            start_chars = sent_chars.get(index, 0)
            start_tokens = sent_tokens.get(index, 0)
            end = stream_end(completion, self.holdback)
            delta = completion.text[start_chars:end]
            # A token that adds no text yet (half a UTF-8 character, an id the tokenizer
            # cannot render) still gets its chunk, as in vLLM: clients count tokens by chunks.
            new_tokens = len(completion.token_ids) > start_tokens
            if not (delta or new_tokens or completion.finish_reason):
                continue
            prefix = self.prompt_text(prompt_index) if first_chunk and self.req.echo else ""
            if completion.finish_reason:
                finished.add(index)
            sent_chars[index] = max(start_chars, start_chars + len(delta))
            sent_tokens[index] = len(completion.token_ids)
            choices.append(
                {
                    "index": index,
                    "text": prefix + delta,
                    "logprobs": self.logprobs(completion, start_tokens, start_chars),
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                }
            )
        return choices
