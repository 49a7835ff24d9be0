"""POST /v1/chat/completions: messages rendered with the model's chat template.

Tools: the request's ``tools`` go to the chat template (which tells the model about them).
``tool_choice`` decides what happens to the output: ``none``, plain text; ``auto`` (the
default when tools are given), the server's ``--tool-call-parser`` finds calls in what the
model wrote; ``required`` and a named function force a call with the grammar engine (a JSON
schema built from the tools), so the output always parses.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request
from starlette.responses import Response

from inference.chat_templates import content_format, default_chat_template
from inference.outputs import CompletionOutput, RequestOutput
from inference.sampling_params import StructuredOutputsParams
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
from inference.server.protocol import ChatCompletionRequest, ChatMessage, Tool, message_dicts
from inference.server.reasoning_parsers import REASONING_PARSERS, ReasoningStream
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
from inference.server.structured import requested_structured_outputs
from inference.server.tool_parsers import (
    TOOL_PARSERS,
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
    ToolStream,
)

logger = logging.getLogger("inference.server")
# A response header (RFC 9111's Warning, code 299: a persistent warning) that clients
# ignore: set when the chat template dropped the request's tools.
WARNING_HEADER = "Warning"
TOOLS_IGNORED = (
    "the chat template ignores tools: the model was not told about them (pass a "
    "tool-capable --chat-template)"
)


@dataclass
class ToolPlan:
    """How a request's output becomes tool calls."""

    parser: ToolParser
    # auto and required: a finished output that made calls ends with "tool_calls" (a named
    # function ends with "stop", as in OpenAI's API)
    finish_as_tool_calls: bool
    constraint: StructuredOutputsParams | None  # required and named: the forced shape


def required_tools_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """A JSON array of one or more ``{"name", "parameters"}`` calls of the given tools."""
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters or {"type": "object"},
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class ChatServing(OpenAIServing):
    _reserved_template_args: frozenset[str] | None = None
    logprobs_param = "top_logprobs"
    _template: tuple[str | None] | None = None  # resolved once the tokenizer is known
    _warned_tools_ignored = False

    def __init__(
        self,
        engine: Any,
        served_model_names: list[str],
        *,
        tool_call_parser: str | None = None,
        enable_auto_tool_choice: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(engine, served_model_names, **kwargs)
        if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"unknown tool call parser {tool_call_parser!r}; "
                f"choose from {', '.join(TOOL_PARSERS)}"
            )
        self.tool_call_parser = tool_call_parser
        self.enable_auto_tool_choice = enable_auto_tool_choice
        name = self.options.reasoning_parser
        if name is not None and name not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {name!r}; choose from {', '.join(REASONING_PARSERS)}"
            )
        self.reasoning_parser = REASONING_PARSERS[name]() if name is not None else None

    @property
    def chat_template(self) -> str | None:
        """--chat-template's text, else the embedded model's tool-capable template, else
        None (the tokenizer's own)."""
        if self._template is None:
            given = self.options.chat_template
            folder = self.engine.engine.tokenizer_path
            self._template = (given if given is not None else default_chat_template(folder),)
        return self._template[0]

    def tool_plan(self, req: ChatCompletionRequest) -> ToolPlan | None:
        """What ``tools`` and ``tool_choice`` ask for (None: plain text); 400 if invalid."""
        choice = req.tool_choice
        if not req.tools:
            return None  # tool_choice without tools is refused by the request's validation
        if choice == "none":
            return None
        if choice is None or choice == "auto":
            if not self.enable_auto_tool_choice or self.tool_call_parser is None:
                raise APIError(
                    400,
                    '"auto" tool choice requires --enable-auto-tool-choice and '
                    "--tool-call-parser to be set",
                    param="tool_choice",
                )
            return ToolPlan(TOOL_PARSERS[self.tool_call_parser](), True, None)
        if requested_structured_outputs(req) is not None:
            raise APIError(
                400,
                "a required or named tool_choice forces the output itself; it cannot be "
                "combined with response_format or structured outputs",
                param="tool_choice",
            )
        if choice == "required":
            schema = required_tools_schema(req.tools, req.parallel_tool_calls is not False)
            return ToolPlan(RequiredToolParser(), True, StructuredOutputsParams(json=schema))
        name = choice.function.name
        tool = next((t for t in req.tools if t.function.name == name), None)
        if tool is None:
            raise APIError(
                400, f"tool_choice names function {name!r}, which is not in tools",
                param="tool_choice",
            )
        schema = tool.function.parameters or {"type": "object"}
        return ToolPlan(NamedToolParser(name), False, StructuredOutputsParams(json=schema))

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[Tool] | None = None,
    ) -> str:
        tokenizer = self.tokenizer
        template = self.chat_template
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions")
        if add_generation_prompt and continue_final_message:
            raise APIError(
                400, "add_generation_prompt and continue_final_message are mutually exclusive"
            )
        # Template variables only: a client must not reach apply_chat_template's own
        # arguments (its template source, tokenize, return types) through these.
        reserved = self._reserved_args(tokenizer)
        extra = {k: v for k, v in (template_kwargs or {}).items() if k not in reserved}
        if tools:
            extra["tools"] = [tool.model_dump(exclude_none=True) for tool in tools]
        if template is not None:
            extra["chat_template"] = template
        template_format = content_format(
            self.options.chat_template_content_format,
            template or getattr(tokenizer, "chat_template", None),
        )
        try:
            text = tokenizer.apply_chat_template(
                message_dicts(messages, template_format),
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
            req.tools,
        )
        prompt = PreparedPrompt(text, self.encode(text, add_special_tokens=False))
        if req.tools and text == self.render_chat(
            req.messages, req.add_generation_prompt, req.continue_final_message,
            req.chat_template_kwargs,
        ):
            prompt.warnings.append(TOOLS_IGNORED)
            if not ChatServing._warned_tools_ignored:
                ChatServing._warned_tools_ignored = True
                logger.warning("a request sent tools, but %s", TOOLS_IGNORED)
        # The rendered template already holds any BOS token it wants.
        return prompt

    def requested_logprobs(self, req: ChatCompletionRequest) -> int | None:
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        lora = self.check_model(req.model)
        self.check_ready()
        tools = self.tool_plan(req)
        self.check_batch(1, req.n)
        prompt = await self.tokenizer_pool.run(raw, self.prepare_prompt, req)
        requested = req.max_completion_tokens or req.max_tokens
        max_tokens = self.resolve_max_tokens(len(prompt.token_ids), requested)
        params = self.sampling_params(
            req, max_tokens, self.requested_logprobs(req),
            tools.constraint if tools is not None else None,
        )
        request_id = self.new_request_id("chatcmpl", raw)
        stream = self.generate([prompt], params, request_id, lora)
        try:
            first = await self.first_output(raw, stream)
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as exc:
            raise engine_error(exc) or exc from exc
        view = _ChatView(self, req, prompt, request_id, tools)
        warnings = ", ".join(f'299 pagoda "{w}"' for w in prompt.warnings)
        headers = {WARNING_HEADER: warnings} if warnings else {}
        if req.stream:
            return StreamingResponse(
                view.stream(first[1], stream), media_type="text/event-stream",
                headers=SSE_HEADERS | headers,
            )
        try:
            finals = await until_disconnected(raw, collect(first, stream))
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as exc:
            raise engine_error(exc) or exc from exc
        return JSONResponse(view.full_response(finals[0]), headers=headers)


@dataclass
class _ChoiceStreams:
    """One streamed choice's parsers: tool calls out of the content, and the reasoning
    apart from it."""

    tools: ToolStream | None
    reasoning: ReasoningStream | None


class _ChatView:
    def __init__(
        self,
        serving: ChatServing,
        req: ChatCompletionRequest,
        prompt: PreparedPrompt,
        request_id: str,
        tools: ToolPlan | None = None,
    ) -> None:
        self.serving = serving
        self.tools = tools
        self.reasoning = serving.reasoning_parser
        self.role = serving.options.response_role
        self.req = req
        self.prompt = prompt
        self.request_id = request_id
        self.created = int(time.time())
        # An adapter's requests answer under its name, as vLLM's do.
        self.model = req.model if serving.adapters.get(req.model) else serving.model_name
        options = req.stream_options
        self.include_usage = bool(options and options.include_usage)
        last = req.messages[-1]
        echo_text = last.content if isinstance(last.content, str) else ""
        self.echo = echo_text if req.echo and last.role == "assistant" else ""

    def logprobs(self, completion: CompletionOutput, start: int) -> dict[str, Any] | None:
        if not self.req.logprobs or completion.logprobs is None:
            return None
        limit = self.req.top_logprobs or 0
        content = []
        for token_id, entry in zip(
            completion.token_ids[start:], completion.logprobs[start:], strict=False
        ):
            sampled = entry.get(token_id)
            text = self.serving.token_text(token_id, sampled)
            content.append(
                {
                    "token": text,
                    "logprob": clamp_logprob(sampled.logprob) if sampled else None,
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [
                        {
                            "token": (alt := self.serving.token_text(tid, lp)),
                            "logprob": clamp_logprob(lp.logprob),
                            "bytes": list(alt.encode("utf-8")),
                        }
                        for tid, lp in (top_logprobs(entry, limit) if limit else [])
                    ],
                }
            )
        return {"content": content}

    def message(self, completion: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        """A finished choice's message and finish reason."""
        finish_reason = completion.finish_reason
        text: str | None = completion.text
        reasoning_fields: dict[str, Any] = {}
        if self.reasoning is not None:
            reasoning, text = self.reasoning.parse(completion.text)
            reasoning_fields["reasoning_content"] = reasoning
        if self.tools is None:
            content = self.echo + text if text is not None else (self.echo or None)
            return {"role": self.role, "content": content, **reasoning_fields}, finish_reason
        content, calls = self.tools.parser.parse(text or "")
        message: dict[str, Any] = {
            "role": self.role,
            "content": self.echo + content if content is not None else (self.echo or None),
            **reasoning_fields,
        }
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
            if self.tools.finish_as_tool_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        return message, finish_reason

    def full_response(self, output: RequestOutput) -> dict[str, Any]:
        choices = []
        for c in output.outputs:
            message, finish_reason = self.message(c)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self.logprobs(c, 0),
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
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

    def _delta(
        self, streams: _ChoiceStreams, completion: CompletionOutput
    ) -> tuple[str, str | None]:
        """A streamed choice's delta (reasoning, content and tool-call deltas) and finish
        reason."""
        finish_reason = completion.finish_reason
        text, reasoning = completion.text, ""
        if streams.reasoning is not None:
            reasoning, text = streams.reasoning.feed(completion.text)
            if finish_reason is not None:
                more_reasoning, more_text = streams.reasoning.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        delta: dict[str, Any] = {"reasoning_content": reasoning} if reasoning else {}
        if streams.tools is None:
            if text:
                delta["content"] = text
            return dumps(delta), finish_reason
        content, calls = streams.tools.feed(text)
        if finish_reason is not None:
            more_content, more_calls = streams.tools.finish()
            content, calls = content + more_content, calls + more_calls
            assert self.tools is not None
            if (streams.tools.num_calls and self.tools.finish_as_tool_calls
                    and finish_reason == "stop"):
                finish_reason = "tool_calls"
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [call.to_openai() for call in calls]
        return dumps(delta), finish_reason

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
                    "delta": {"role": self.role, "content": self.echo},
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
        plain = self.tools is None and self.reasoning is None
        choice_streams = {
            i: _ChoiceStreams(
                self.tools.parser.stream() if self.tools else None,
                self.reasoning.stream() if self.reasoning else None,
            )
            for i in range(self.req.n)
        }
        num_tokens = 0
        try:
            output: RequestOutput | None = first
            while output is not None:
                choices = []
                for c in output.outputs:
                    num_tokens += len(c.token_ids)
                    finish_reason = c.finish_reason
                    if plain:
                        delta = f'{{"content":{dumps(c.text)}}}' if c.text else "{}"
                    else:
                        delta, finish_reason = self._delta(choice_streams[c.index], c)
                    choices.append(
                        f'{{"index":{c.index},"delta":{delta}'
                        + choice_end(self.logprobs(c, 0), finish_reason, c.stop_reason)
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
