"""--reasoning-parser: <think> text in reasoning_content, the answer in content, streamed
and not, with vLLM's semantics (deepseek_r1: the <think> start may be in the prompt;
qwen3: reasoning only when the output opens a <think> block)."""

from __future__ import annotations

import asyncio
import json

import pytest

from inference.outputs import CompletionOutput, RequestOutput
from inference.server.chat import ChatServing, _ChatView
from inference.server.protocol import ChatCompletionRequest
from inference.server.reasoning_parsers import REASONING_PARSERS
from inference.server.serving import PreparedPrompt, ServingOptions

CASES = [
    # (parser, output, reasoning, content)
    ("deepseek_r1", "<think>add 2 and 2</think>4", "add 2 and 2", "4"),
    ("deepseek_r1", "add 2 and 2</think>\n\n4", "add 2 and 2", "\n\n4"),  # <think> in prompt
    ("deepseek_r1", "still thinking", "still thinking", None),  # cut before </think>
    ("deepseek_r1", "thought</think>", "thought", None),
    ("qwen3", "<think>add 2 and 2</think>4", "add 2 and 2", "4"),
    ("qwen3", "\n<think>hm</think>ok", "hm", "ok"),
    ("qwen3", "4, no thinking", None, "4, no thinking"),
    ("qwen3", "<think></think>4", None, "4"),
    ("qwen3", "<think>unfinished", "unfinished", None),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_parse_whole_output(name, text, reasoning, content) -> None:
    assert REASONING_PARSERS[name]().parse(text) == (reasoning, content)


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
@pytest.mark.parametrize("piece", [1, 2, 3, 5])
def test_stream_split_anywhere_adds_up(name, text, reasoning, content, piece) -> None:
    stream = REASONING_PARSERS[name]().stream()
    got_reasoning, got_content = "", ""
    for start in range(0, len(text), piece):
        r, c = stream.feed(text[start:start + piece])
        got_reasoning, got_content = got_reasoning + r, got_content + c
    r, c = stream.finish()
    got_reasoning, got_content = got_reasoning + r, got_content + c
    assert (got_reasoning or None, got_content or None) == (reasoning, content)


def _serving(**options) -> ChatServing:
    # The view needs no engine: what it renders comes from the outputs given to it.
    return ChatServing(None, ["m"], options=ServingOptions(**options),
                       tool_call_parser="hermes", enable_auto_tool_choice=True)


def _output(text: str, finish: str | None, index: int = 0) -> RequestOutput:
    completion = CompletionOutput(index, text, [1] * max(1, len(text) // 4), None, None,
                                  finish_reason=finish)
    return RequestOutput("r", None, [1], [completion], finish is not None)


def _view(serving: ChatServing, **request) -> _ChatView:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "2+2?"}], **request)
    return _ChatView(serving, req, PreparedPrompt("p", [1]), "chatcmpl-1",
                     serving.tool_plan(req))


def test_chat_message_carries_reasoning_and_tool_calls_from_content() -> None:
    serving = _serving(reasoning_parser="deepseek_r1", response_role="bot")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    view = _view(serving, tools=tools)
    text = 'I should call add</think><tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    message = view.full_response(_output(text, "stop"))["choices"][0]
    assert message["message"]["reasoning_content"] == "I should call add"
    assert message["message"]["role"] == "bot"
    assert message["message"]["tool_calls"][0]["function"]["name"] == "add"
    assert message["finish_reason"] == "tool_calls"


def test_streamed_reasoning_arrives_as_delta_reasoning_content() -> None:
    view = _view(_serving(reasoning_parser="qwen3"), stream=True)
    pieces = ["<thi", "nk>two plus", " two</th", "ink>4", "."]

    async def rest():
        for i, piece in enumerate(pieces[1:], 1):
            yield 0, _output(piece, "stop" if i == len(pieces) - 1 else None)

    async def run() -> list[str]:
        return [chunk async for chunk in view.stream(_output(pieces[0], None), rest())]

    chunks = [json.loads(c[6:]) for c in asyncio.run(run()) if c.startswith("data: {")]
    deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert (reasoning, content) == ("two plus two", "4.")
    assert deltas[0]["role"] == "assistant"
