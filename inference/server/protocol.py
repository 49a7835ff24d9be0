"""Request bodies of the OpenAI-compatible API, plus vLLM's extra sampling fields.

Field names and defaults follow OpenAI's and vLLM's so existing clients and load tools send
requests unchanged. Unknown fields are ignored (as vLLM does) rather than rejected, because
load tools often send vendor fields we have no use for. Numbers must be finite: a NaN
temperature would pass ``SamplingParams``' range checks and poison the sampler.

Every string of a request body must be valid Unicode: JSON lets a client send a lone UTF-16
surrogate (``"\\ud800"``), which Python keeps as a str that no tokenizer or encoder can take;
request bodies reject it up front, naming the field. Cross-field rules (``stream_options``
without ``stream``, ``tool_choice`` without ``tools``) are checked as strictly as vLLM does;
their errors carry the field's name in ``ctx["param"]`` for the error handler.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
# An upper bound on n: each choice is a sequence in the running batch.
MAX_N = 128

TokenId = Annotated[int, Field(ge=0, le=_INT64_MAX)]
Int64 = Annotated[int, Field(ge=_INT64_MIN, le=_INT64_MAX)]


# OpenAI's range for logit_bias values.
MAX_LOGIT_BIAS = 100.0


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def field_error(param: str, message: str) -> PydanticCustomError:
    """A validation error about ``param`` (a dotted path) raised by a model validator, whose
    location pydantic would otherwise report as the whole body."""
    context = {"param": param, "message": message}
    return PydanticCustomError("invalid_field", "{param}: {message}", context)


def _has_lone_surrogate(value: Any) -> bool:
    """Whether any string (or key) in ``value`` is not valid Unicode. A request's bulk is
    numbers (token ids, logit biases): they are skipped without building a path each."""
    if isinstance(value, str):
        if value.isascii():
            return False
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value if not isinstance(v, (int, float)))
    return False


def _lone_surrogate_path(value: Any, path: str) -> str | None:
    """The dotted path of the first string (or key) in ``value`` that is not valid Unicode."""
    if not _has_lone_surrogate(value):
        return None
    if isinstance(value, str):
        return path or "body"
    if isinstance(value, dict):
        for key, item in value.items():
            # The path is echoed in the error message: it must be valid Unicode itself.
            name = str(key).encode("utf-8", "backslashreplace").decode("utf-8")
            where = f"{path}.{name}" if path else name
            found = _lone_surrogate_path(key, where) or _lone_surrogate_path(item, where)
            if found:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _lone_surrogate_path(item, f"{path}.{index}" if path else str(index))
            if found:
                return found
    return None


class _Request(_Model):
    """A whole request body."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = _lone_surrogate_path(data, "")
        if where is not None:
            raise field_error(
                where, "contains a lone UTF-16 surrogate (e.g. \\ud800), which is not valid Unicode"
            )
        return data


class StreamOptions(_Model):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage so far on every chunk


class JsonSchemaFormat(_Model):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    """OpenAI's ``response_format``: plain text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Model):
    """vLLM's ``structured_outputs`` request field (one constraint)."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class _SamplingFields(_Request):
    """Sampling fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1, le=_INT64_MAX)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = Field(None, ge=-1, le=_INT64_MAX)  # 0 or -1: disabled
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=_INT64_MAX)
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its
    # older guided_* fields (at most one of them per request).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.strip().isdigit():
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"values must be in [-100, 100], got {bias} for token {key}")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise field_error("stream_options", "only allowed when stream is true")
        return self


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    # 0 with echo: score the prompt only (its logprobs), as lm-eval-harness does.
    max_tokens: int | None = Field(16, ge=0, le=_INT64_MAX)
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0)  # at most --max-logprobs (400 above)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None


class TextContentPart(_Model):
    type: Literal["text"]
    text: str


class FunctionCall(_Model):
    name: str
    arguments: str  # JSON text, as the model wrote it or as OpenAI clients send it back


class ToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: str = Field(min_length=1)
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: which call it answers


class FunctionDefinition(_Model):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=_INT64_MAX)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0)  # at most --max-logprobs (400 above)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    # vLLM's chat-template controls.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> ChatCompletionRequest:
        if self.tool_choice not in (None, "none") and not self.tools:
            raise field_error("tool_choice", "requires tools: set tools, or tool_choice to none")
        return self


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


class LoadLoRAAdapterRequest(_Request):  # vLLM's /v1/load_lora_adapter body
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Request):  # vLLM's /v1/unload_lora_adapter body
    lora_name: str = Field(min_length=1)


def message_dicts(
    messages: list[ChatMessage], content_format: str = "string"
) -> list[dict[str, Any]]:
    """Messages as the plain dicts chat templates expect; text parts are joined
    (``content_format`` "string") or kept as OpenAI's list of parts ("openai"). An
    assistant's tool calls keep their ids, and their arguments become objects (templates
    render them with ``tojson``), as vLLM passes them; a tool message keeps the id of the
    call it answers."""
    result = []
    for message in messages:
        content: Any = message.content
        if isinstance(content, str) and content_format == "openai":
            content = [{"type": "text", "text": content}]
        elif isinstance(content, list) and content_format == "openai":
            content = [{"type": "text", "text": part.text} for part in content]
        elif isinstance(content, list):
            content = "\n".join(part.text for part in content)
        entry: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": call.type,
                    "function": {
                        "name": call.function.name,
                        "arguments": _json_or_text(call.function.arguments),
                    },
                }
                for call in message.tool_calls
            ]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        result.append(entry)
    return result


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
