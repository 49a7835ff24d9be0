"""POST /v1/chat/completions: messages rendered with the model's chat template."""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request
from starlette.responses import Response

from inference.outputs import CompletionOutput, RequestOutput
from inference.server.completions import (
    DONE,
    SSE_HEADERS,
    ChunkEnvelope,
    choice_end,
    chunk_payload,
    continuous_usage,
    dumps,
    sse,
)
from inference.server.errors import APIError, error_body
from inference.server.protocol import ChatCompletionRequest, ChatMessage, message_dicts
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


class ChatServing(OpenAIServing):
    _reserved_template_args: frozenset[str] | None = None

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        tokenizer = self.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions")
        if add_generation_prompt and continue_final_message:
            raise APIError(
                400, "add_generation_prompt and continue_final_message are mutually exclusive"
            )
        # Template variables only: a client must not reach apply_chat_template's own
        # arguments (its template source, tokenize, return types) through these.
        reserved = self._reserved_args(tokenizer)
        extra = {k: v for k, v in (template_kwargs or {}).items() if k not in reserved}
        try:
            text = tokenizer.apply_chat_template(
                message_dicts(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **extra,
            )
        except Exception as exc:  # jinja errors, raise_exception() in templates, bad roles
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
        if not isinstance(text, str):
            raise APIError(400, "the chat template did not render text", param="messages")
        return text

    def _reserved_args(self, tokenizer: Any) -> frozenset[str]:
        if ChatServing._reserved_template_args is None:
            params = inspect.signature(tokenizer.apply_chat_template).parameters
            names = {n for n, p in params.items() if p.kind is not p.VAR_KEYWORD}
            ChatServing._reserved_template_args = frozenset(names | {"chat_template"})
        return ChatServing._reserved_template_args

    def prepare_prompt(self, req: ChatCompletionRequest) -> PreparedPrompt:
        text = self.render_chat(
            req.messages,
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
        )
        # The rendered template already holds any BOS token it wants.
        return PreparedPrompt(text, self.encode(text, add_special_tokens=False))

    def requested_logprobs(self, req: ChatCompletionRequest) -> int | None:
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        self.check_ready()
        if req.tools:
            raise APIError(400, "tools are not supported", param="tools")
        self.check_batch(1, req.n)
        prompt = await self.tokenizer_pool.run(raw, self.prepare_prompt, req)
        requested = req.max_completion_tokens or req.max_tokens
        max_tokens = self.resolve_max_tokens(len(prompt.token_ids), requested)
        params = self.sampling_params(req, max_tokens, self.requested_logprobs(req))
        request_id = self.new_request_id("chatcmpl", raw)
        stream = self.generate([prompt], params, request_id)
        try:
            first = await self.first_output(raw, stream)
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as exc:
            raise engine_error(exc) or exc from exc
        view = _ChatView(self, req, prompt, request_id)
        if req.stream:
            return StreamingResponse(
                view.stream(first[1], stream), media_type="text/event-stream", headers=SSE_HEADERS
            )
        try:
            finals = await until_disconnected(raw, collect(first, stream))
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as exc:
            raise engine_error(exc) or exc from exc
        return JSONResponse(view.full_response(finals[0]))


class _ChatView:
    def __init__(
        self,
        serving: ChatServing,
        req: ChatCompletionRequest,
        prompt: PreparedPrompt,
        request_id: str,
    ) -> None:
        self.serving = serving
        self.req = req
        self.prompt = prompt
        self.request_id = request_id
        self.created = int(time.time())
        self.model = serving.model_name
        options = req.stream_options
        self.include_usage = bool(options and options.include_usage)
        last = req.messages[-1]
        echo_text = last.content if isinstance(last.content, str) else ""
        self.echo = echo_text if req.echo and last.role == "assistant" else ""

    def logprobs(self, completion: CompletionOutput, start: int) -> dict[str, Any] | None:
        if not self.req.logprobs or completion.logprobs is None:
            return None
        tokenizer = self.serving.tokenizer
        limit = self.req.top_logprobs or 0
        content = []
        for token_id, entry in zip(
            completion.token_ids[start:], completion.logprobs[start:], strict=False
        ):
            sampled = entry.get(token_id)
            text = token_text(tokenizer, token_id, sampled)
            content.append(
                {
                    "token": text,
                    "logprob": clamp_logprob(sampled.logprob) if sampled else None,
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [
                        {
                            "token": (alt := token_text(tokenizer, tid, lp)),
                            "logprob": clamp_logprob(lp.logprob),
                            "bytes": list(alt.encode("utf-8")),
                        }
                        for tid, lp in (top_logprobs(entry, limit) if limit else [])
                    ],
                }
            )
        return {"content": content}

    def full_response(self, output: RequestOutput) -> dict[str, Any]:
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": self.echo + c.text},
                "logprobs": self.logprobs(c, 0),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in output.outputs
        ]
        return {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage([self.prompt], {0: output}),
        }

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return chunk_payload(self, "chat.completion.chunk", choices)

    async def stream(
        self, first: RequestOutput, rest: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[str]:
        """The role chunk, then one chunk per engine step that produced something."""
        # OpenAI opens every choice with the role before any content.
        continuous = continuous_usage(self.req)
        role_chunk = self.chunk(
            [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": self.echo},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(self.req.n)
            ]
        )
        if continuous:
            role_chunk["usage"] = usage_counts([self.prompt], 0)
        yield sse(role_chunk)
        envelope = ChunkEnvelope(self, "chat.completion.chunk")
        num_tokens = 0
        try:
            output: RequestOutput | None = first
            while output is not None:
                choices = []
                for c in output.outputs:
                    num_tokens += len(c.token_ids)
                    content = f'{{"content":{dumps(c.text)}}}' if c.text else "{}"
                    choices.append(
                        f'{{"index":{c.index},"delta":{content}'
                        + choice_end(self.logprobs(c, 0), c.finish_reason, c.stop_reason)
                    )
                if choices:
                    counts = usage_counts([self.prompt], num_tokens) if continuous else None
                    yield envelope.render(choices, counts)
                item = await anext(rest, None)
                output = item[1] if item is not None else None
        except Exception as exc:
            error = engine_error(exc) or APIError(500, f"internal error: {type(exc).__name__}")
            yield sse(error_body(error.status, error.message, error.param, error.code))
        finally:
            await rest.aclose()  # type: ignore[attr-defined]
        if self.include_usage:
            payload = self.chunk([])
            payload["usage"] = usage_counts([self.prompt], num_tokens)
            yield sse(payload)
        yield DONE
