"""Tool-call parsers on hand-written model outputs, whole and streamed in every split: a
streamed call opens with its id and name (arguments "") and its arguments follow in
fragments as they are generated, adding up to exactly the non-streamed arguments."""

from __future__ import annotations

import json

import pytest

from inference.server.protocol import ChatMessage, message_dicts
from inference.server.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
)


def calls_of(parser: ToolParser, text: str):
    content, calls = parser.parse(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def streamed_raw(parser: ToolParser, text: str, piece: int):
    """Feed ``text`` in pieces of ``piece`` characters; (content, [(name, arguments text,
    number of argument fragments)]) as a client that concatenates the deltas sees them."""
    stream = parser.stream()
    content, calls = "", {}
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    steps = [stream.feed(p) for p in pieces] + [stream.finish()]
    for delta_content, deltas in steps:
        content += delta_content
        for delta in deltas:
            if delta.id is not None:
                assert delta.index not in calls, "a call's id is sent once"
                assert delta.index == len(calls), "calls are numbered 0, 1, ... in order"
                assert delta.arguments == "", "the first delta names the call only"
                assert delta.id.startswith("chatcmpl-tool-") and delta.name
                calls[delta.index] = {"name": delta.name, "arguments": "", "fragments": 0}
            else:
                entry = calls[delta.index]  # never a fragment before its call's first delta
                assert delta.arguments, "no empty fragments"
                entry["arguments"] += delta.arguments
                entry["fragments"] += 1
        assert "<tool_call>" not in content and "</tool_call>" not in content or not calls
    ordered = [calls[i] for i in sorted(calls)]
    return content, [(c["name"], c["arguments"], c["fragments"]) for c in ordered]


def streamed(parser: ToolParser, text: str, piece: int):
    content, calls = streamed_raw(parser, text, piece)
    return content, [(name, json.loads(arguments)) for name, arguments, _ in calls]


HERMES_CASES = [
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
        "</tool_call>",
        None,
        [("get_weather", {"city": "Paris", "unit": "c"})],
    ),
    (
        'Let me check both.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"s": "</tool"}}\n</tool_call>',
        "Let me check both.",
        [("a", {"x": 1}), ("b", {"s": "</tool"})],
    ),
    # A closing tag inside an argument string is text, not the end of the call.
    ('<tool_call>{"name": "say", "arguments": {"text": "</tool_call> ends it"}}</tool_call>',
     None, [("say", {"text": "</tool_call> ends it"})]),
    # Cut off before its closing tag (max_tokens at the very end): still a call.
    ('<tool_call>\n{"name": "a", "arguments": {}}', None, [("a", {})]),
    ("No tools needed: 2 < 3.", "No tools needed: 2 < 3.", []),
    # Not JSON inside the tags: the text as written, no calls.
    ("<tool_call>oops</tool_call>", "<tool_call>oops</tool_call>", []),
]


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes(text, content, calls):
    assert calls_of(HermesToolParser(), text) == (content, calls)


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_hermes_streamed(text, content, calls, piece):
    streamed_content, streamed_calls = streamed(HermesToolParser(), text, piece)
    assert streamed_calls == calls
    # Streaming sends all text outside the calls (vLLM's non-streamed content is trimmed).
    assert streamed_content.strip() == (content or "").strip()


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", {"city": "Oslo"})]),
    ('<|python_tag|>{"name": "a", "parameters": {"n": [1, 2]}}; {"name": "b", "arguments": {}}',
     None, [("a", {"n": [1, 2]}), ("b", {})]),
    ("The weather is fine.", "The weather is fine.", []),
    # Arguments before the name, and as a JSON string (as some models write them).
    ('{"parameters": {"q": "}{"}, "name": "late"}; {"name": "s", "parameters": "{\\"k\\": 1}"}',
     None, [("late", {"q": "}{"}), ("s", {"k": 1})]),
]
# Cut off once the name is out: the call was already sent when streaming, so it stands
# with the arguments generated so far (as OpenAI's own truncated calls do); not streamed,
# the output is returned as the text it is.
LLAMA_CUT = '{"name": "broken", "parameters": {"x": '



@pytest.mark.parametrize("text, content, calls", LLAMA_CASES)
def test_llama3_json(text, content, calls):
    assert calls_of(Llama3JsonToolParser(), text) == (content, calls)


@pytest.mark.parametrize("text, content, calls", LLAMA_CASES)
@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_llama3_json_streamed(text, content, calls, piece):
    streamed_content, streamed_calls = streamed(Llama3JsonToolParser(), text, piece)
    assert streamed_calls == calls
    assert (streamed_content or None) == content


def test_llama3_json_cut_short():
    assert calls_of(Llama3JsonToolParser(), LLAMA_CUT) == (LLAMA_CUT, [])
    for piece in (1, 1000):
        content, calls = streamed_raw(Llama3JsonToolParser(), LLAMA_CUT, piece)
        assert content == "" and [c[:2] for c in calls] == [("broken", '{"x": ')]


LONG_ARGUMENTS = (
    '{"query": "the history of paged attention in LLM serving, with sources", '
    '"filters": {"years": [2023, 2024], "lang": "en", "note": "quote \\"this\\" \\u00e9"}, '
    '"limit": 10}'
)
STREAMING_CASES = [
    (HermesToolParser, "I will look that up.\n<tool_call>\n"
     f'{{"name": "search", "arguments": {LONG_ARGUMENTS}}}\n</tool_call>\n'
     '<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>',
     "I will look that up.\n\n"),  # all text between the calls is content
    (Llama3JsonToolParser, f'{{"name": "search", "parameters": {LONG_ARGUMENTS}}}; '
     '{"name": "clock", "parameters": {}}', ""),
    (RequiredToolParser, f'[{{"name": "search", "parameters": {LONG_ARGUMENTS}}}, '
     '{"name": "clock", "parameters": {}}]', ""),
]


@pytest.mark.parametrize("parser_class, text, content", STREAMING_CASES)
@pytest.mark.parametrize("piece", [1, 2, 5])
def test_arguments_stream_as_they_are_generated(parser_class, text, content, piece):
    """A long argument arrives in many fragments, which add up to exactly the arguments
    the whole output parses to; the content before the calls streams, the markup never."""
    streamed_content, calls = streamed_raw(parser_class(), text, piece)
    _, whole = parser_class().parse(text)
    assert [(c.name, c.arguments) for c in whole] == [c[:2] for c in calls]
    assert [c[0] for c in calls] == ["search", "clock"]
    assert calls[0][1] == LONG_ARGUMENTS and json.loads(calls[0][1])["limit"] == 10
    assert calls[0][2] > 10  # many fragments, not one whole
    assert calls[1][1] == "{}"
    assert streamed_content == content


def test_hermes_content_streams_before_the_call_completes():
    stream = HermesToolParser().stream()
    assert stream.feed("Sure") == ("Sure", [])
    assert stream.feed(", checking.<tool") == (", checking.", [])  # "<tool" may be a tag
    assert stream.feed('_call>{"name": "f') == ("", [])
    (first,) = stream.feed('n", "arguments": ')[1]
    assert (first.index, first.name, first.arguments) == (0, "fn", "")
    assert [d.arguments for d in stream.feed('{"a": [1,')[1]] == ['{"a": [1,']
    assert [d.arguments for d in stream.feed(" 2]}}")[1]] == [" 2]}"]
    assert stream.feed("</tool_call> Done.") == (" Done.", [])


def test_required_array():
    text = '[{"name": "a", "parameters": {"q": "x}]"}}, {"name": "b", "parameters": {}}]'
    expected = [("a", {"q": "x}]"}), ("b", {})]
    assert calls_of(RequiredToolParser(), text) == (None, expected)
    for piece in (1, 5, 1000):
        assert streamed(RequiredToolParser(), text, piece) == ("", expected)
    # Cut short by max_tokens: the text comes back as content.
    assert RequiredToolParser().parse('[{"name": "a"') == ('[{"name": "a"', [])


def test_named_function_streams_its_arguments():
    parser = NamedToolParser("lookup")
    text = '{"term": "llama", "limit": 3}'
    assert calls_of(parser, text) == (None, [("lookup", {"term": "llama", "limit": 3})])
    stream = parser.stream()
    first = stream.feed(text[:5])[1]
    assert [(d.name, d.arguments) for d in first] == [("lookup", ""), (None, text[:5])]
    rest = stream.feed(text[5:])[1]
    assert rest[0].id is None and rest[0].arguments == text[5:]
    assert streamed(parser, text, 2) == ("", [("lookup", {"term": "llama", "limit": 3})])


def test_tool_messages_reach_the_chat_template():
    """An assistant's tool calls (arguments as objects, as templates expect) and the tool
    results are kept, not dropped."""
    messages = [
        ChatMessage(role="user", content="Weather in Paris?"),
        ChatMessage(role="assistant", content=None, tool_calls=[{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }]),
        ChatMessage(role="tool", content="18 C, sunny", tool_call_id="call_1"),
    ]
    dicts = message_dicts(messages)
    assert dicts[1]["tool_calls"] == [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }]
    assert dicts[2] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}
    from jinja2 import Template

    template = Template(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<call {{ c.id }}>{{ c.function.name }}"
        "{{ c.function.arguments | tojson }}{% endfor %}"
        "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}{% endfor %}"
    )
    text = template.render(messages=dicts)
    assert '<call call_1>get_weather{"city": "Paris"}' in text
    assert "<tool>18 C, sunny[call_1]" in text
