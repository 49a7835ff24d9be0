"""Request bodies of the OpenAI-compatible API, plus vLLM's extra sampling fields.

Field names and defaults follow OpenAI's and vLLM's so existing clients and load tools send
requests unchanged. Unknown fields are ignored (as vLLM does) rather than rejected, because
load tools often send vendor fields we have no use for. Numbers must be finite: a NaN
temperature would pass ``SamplingParams``' range checks and poison the sampler.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
# An upper bound on n: each choice is a sequence in the running batch.
MAX_N = 128

TokenId = Annotated[int, Field(ge=0, le=_INT64_MAX)]
Int64 = Annotated[int, Field(ge=_INT64_MIN, le=_INT64_MAX)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool | None = False


class _SamplingFields(_Model):
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
    top_k: Int64 | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=_INT64_MAX)
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1, le=_INT64_MAX)
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None


class TextContentPart(_Model):
    type: Literal["text"]
    text: str


class ChatMessage(_Model):
    role: str = Field(min_length=1)
    content: str | list[TextContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=_INT64_MAX)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    # vLLM's chat-template controls.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeCompletionRequest(_Model):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_Model):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[TokenId]


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the plain dicts chat templates expect; text parts are joined."""
    result = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        entry: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        result.append(entry)
    return result
