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
    collect,
    engine_error,
    token_text,
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

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        self.check_ready()
        self.validate(req)
        raw_prompts = self.raw_prompts(req)
        self.check_batch(len(raw_prompts), req.n)
        prompts = await self.tokenizer_pool.run(raw, self.prepare_prompts, raw_prompts)
        max_tokens = min(self.resolve_max_tokens(len(p.token_ids), req.max_tokens) for p in prompts)
        params = self.sampling_params(req, max_tokens, req.logprobs)
        request_id = self.new_request_id("cmpl", raw)
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
        self.model = serving.model_name

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
        # chunk, as in vLLM: clients count tokens by chunks.
        choices = []
        n = self.req.n
        for completion in output.outputs:
            index = prompt_index * n + completion.index
            start_chars = sent_chars.get(index)
            text = completion.text
            if start_chars is None:
                start_chars = 0
                if self.req.echo:
                    text = self.prompt_text(prompt_index) + text
            sent_chars[index] = start_chars + len(completion.text)
            logprobs = self.logprobs(completion, 0, start_chars)
            choices.append(
                f'{{"index":{index},"text":{dumps(text)}'
                + choice_end(logprobs, completion.finish_reason, completion.stop_reason)
            )
        return choices
