"""Streamed tool calls through the official `openai` client against a real server with the
embedded SmolLM2, for each --tool-call-parser: a call opens with its index, id, type and
name (arguments ""), its arguments follow in fragments as they are generated and add up to
exactly the non-streamed arguments, the content before a call streams as content, and the
markup never does.

The small model does not call tools by itself, so its output is scripted: a one-option
``structured_outputs.choice`` forces the exact text a tool-calling model would write, token
by token through the real engine, tokenizer and detokenizer (a tag arrives split over
several tokens, as it does from a real model)."""

from __future__ import annotations

import openai
import pytest
from server_harness import ServerThread

from inference.server.tool_parsers import TOOL_PARSERS

MODEL = "smollm2"
TOOLS = [
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "limit": {"type": "integer"}}}}},
    {"type": "function", "function": {
        "name": "clock", "description": "The time now", "parameters": {"type": "object"}}},
]
ARGUMENTS = '{"query": "paged attention, \\"vLLM\\"", "limit": 5}'
SCRIPTS = {
    "hermes": (
        'Let me look.<tool_call>{"name": "search", "arguments": ' + ARGUMENTS + '}</tool_call>'
        '<tool_call>{"name": "clock", "arguments": {}}</tool_call>',
        "Let me look.",
    ),
    "llama3_json": (
        '{"name": "search", "parameters": ' + ARGUMENTS + '}; '
        '{"name": "clock", "parameters": {}}',
        "",
    ),
}
QUESTION = [{"role": "user", "content": "Find the paged attention paper, and the time."}]


@pytest.fixture(scope="module", params=sorted(SCRIPTS))
def served(request, smol_model):
    parser = request.param
    server = ServerThread(
        smol_model, served_model_names=[MODEL], max_model_len=512, num_kv_blocks=64,
        app_kwargs={"tool_call_parser": parser, "enable_auto_tool_choice": True},
    ).start()
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=300) as c:
        yield parser, c
    server.stop()


def _request(parser: str) -> dict:
    script, _ = SCRIPTS[parser]
    return dict(model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=120, temperature=0.0,
                extra_body={"structured_outputs": {"choice": [script]}})


def test_tool_calls_stream_incrementally(served):
    """One streamed request, read chunk by chunk and by the client's own accumulation
    (ChatCompletionStreamState), against what the whole output parses to."""
    parser, client = served
    _, expected_content = SCRIPTS[parser]
    calls: dict[int, dict] = {}
    content, finish = "", None
    with client.chat.completions.stream(**_request(parser)) as stream:
        for event in stream:
            if event.type != "chunk" or not event.chunk.choices:
                continue
            choice = event.chunk.choices[0]
            assert "tool_call" not in (choice.delta.content or ""), "markup leaked"
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    assert delta.index == len(calls)  # 0, 1, ... in order
                    assert delta.type == "function" and delta.function.arguments == ""
                    calls[delta.index] = {"name": delta.function.name, "arguments": "",
                                          "fragments": 0}
                else:
                    calls[delta.index]["arguments"] += delta.function.arguments
                    calls[delta.index]["fragments"] += 1
            finish = choice.finish_reason or finish
        accumulated = stream.get_final_completion().choices[0]
    assert finish == "tool_calls"
    assert content == expected_content
    assert [c["name"] for c in calls.values()] == ["search", "clock"]
    assert calls[0]["arguments"] == ARGUMENTS
    assert calls[0]["fragments"] > 3  # sent as generated, a few tokens at a time
    assert calls[1]["arguments"] == "{}"
    streamed = [(c["name"], c["arguments"]) for c in calls.values()]

    assert accumulated.finish_reason == "tool_calls"
    assert (accumulated.message.content or "") == expected_content
    assert [(c.function.name, c.function.arguments)
            for c in accumulated.message.tool_calls] == streamed
    assert all(c.id.startswith("chatcmpl-tool-") for c in accumulated.message.tool_calls)

    # Not streamed, the server parses the same output text with the same parser (one
    # generation less on a 2-core CI box; tests/server/test_structured_openai.py covers
    # non-streamed tool calls over HTTP).
    script, _ = SCRIPTS[parser]
    content_whole, whole = TOOL_PARSERS[parser]().parse(script)
    assert content_whole == (expected_content or None)
    assert [(c.name, c.arguments) for c in whole] == streamed
