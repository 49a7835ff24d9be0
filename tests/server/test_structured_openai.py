"""Structured outputs and tool calls through the official `openai` client against a real
server with the embedded SmolLM2: response_format, vLLM's structured_outputs and guided_*
fields, tools with tool_choice required / named / auto (hermes parser), streamed and not."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import ValidationError
from server_harness import ServerThread

from inference.server.chat import ChatServing
from inference.server.errors import APIError
from inference.server.protocol import ChatCompletionRequest
from inference.server.tool_parsers import HermesToolParser

MODEL = "smollm2"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "hobbies": {"type": "array", "items": {"enum": ["chess", "tennis", "music"]},
                    "maxItems": 2},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "London", "Tokyo"]},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}},
                       "required": ["city"], "additionalProperties": False}}},
]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smol_model):
    server = ServerThread(
        smol_model, served_model_names=[MODEL], max_model_len=512, num_kv_blocks=128,
        app_kwargs={"tool_call_parser": "hermes", "enable_auto_tool_choice": True},
    ).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=300) as c:
        yield c


def _person_format():
    return {"type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_response_format_json_schema(client, stream):
    kwargs = dict(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=80, temperature=0.0, response_format=_person_format(),
    )
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        text, finish = choice.message.content, choice.finish_reason
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_guided_choice_and_regex(client, stream):
    prompts = ["My favourite fruit is", "The year is"]
    bodies = [{"guided_choice": ["apple", "banana", "cherry"]},
              {"structured_outputs": {"regex": "19[0-9]{2}|20[0-2][0-9]"}}]
    for prompt, body in zip(prompts, bodies):
        kwargs = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0,
                      extra_body=body)
        if stream:
            chunks = list(client.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
        else:
            text = client.completions.create(**kwargs).choices[0].text
        if "guided_choice" in body:
            assert text in ("apple", "banana", "cherry")
        else:
            assert re.fullmatch("19[0-9]{2}|20[0-2][0-9]", text)


def test_chat_json_object_and_guided_json(client):
    response = client.chat.completions.create(
        model=MODEL, max_tokens=40, temperature=0.0,
        messages=[{"role": "user", "content": 'Reply with the JSON object {"ok": true}.'}],
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(response.choices[0].message.content), dict)
    answer = {"type": "object", "properties": {"capital": {"enum": ["Paris", "Lyon"]}},
              "required": ["capital"], "additionalProperties": False}
    response = client.chat.completions.create(
        model=MODEL, max_tokens=30, temperature=0.0,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        extra_body={"guided_json": answer},
    )
    assert json.loads(response.choices[0].message.content) == {"capital": "Paris"}


@pytest.mark.parametrize(
    "body, message",
    [
        ({"guided_json": {"type": "objekt"}}, "invalid structured output JSON schema"),
        ({"guided_regex": "a(b"}, "invalid structured output regex"),
        ({"guided_grammar": "start: nowhere"}, "invalid structured output grammar"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "at most one"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "json_schema.schema"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ],
)
def test_invalid_constraints_are_400(client, body, message):
    with pytest.raises(openai.BadRequestError, match=re.escape(message)):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            extra_body=body,
        )


def _accumulate_tool_calls(chunks) -> tuple[dict[int, dict], str | None, str]:
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(
                delta.index, {"id": None, "name": None, "arguments": "", "fragments": 0}
            )
            if delta.id:
                assert delta.function.arguments == ""  # the first delta names the call
                entry["id"], entry["name"] = delta.id, delta.function.name
            else:
                entry["arguments"] += delta.function.arguments
                entry["fragments"] += 1
        finish = choice.finish_reason or finish
    return calls, finish, content


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required(client, stream):
    # One call (parallel_tool_calls=False) keeps the output short; arrays of several calls
    # are covered by the parser tests.
    kwargs = dict(model=MODEL, messages=WEATHER_QUESTION, tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_tokens=60, temperature=0.0)
    if stream:
        calls, finish, content = _accumulate_tool_calls(
            client.chat.completions.create(stream=True, **kwargs)
        )
        parsed = [(c["id"], c["name"], c["arguments"]) for c in calls.values()]
        assert content == ""
        assert all(c["fragments"] > 1 for c in calls.values())  # streamed as generated
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        finish = choice.finish_reason
        parsed = [(c.id, c.function.name, c.function.arguments)
                  for c in choice.message.tool_calls]
        assert choice.message.content is None
    assert finish == "tool_calls"
    assert len(parsed) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call_id, name, arguments in parsed:
        assert call_id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(arguments), schemas[name])


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice(client, stream):
    kwargs = dict(model=MODEL, messages=WEATHER_QUESTION, tools=TOOLS, max_tokens=40,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  temperature=0.0)
    if stream:
        calls, finish, _ = _accumulate_tool_calls(
            client.chat.completions.create(stream=True, **kwargs)
        )
        assert list(calls) == [0]
        name, arguments = calls[0]["name"], calls[0]["arguments"]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        finish = choice.finish_reason
        (call,) = choice.message.tool_calls
        name, arguments = call.function.name, call.function.arguments
    assert finish == "stop"  # as OpenAI ends a forced function call
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMS)


def test_auto_tool_choice_and_tool_results_in_history(client):
    """auto: the hermes parser looks for calls in free text (this small model answers in
    prose); an earlier call and its result are part of the conversation."""
    messages = WEATHER_QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=12, temperature=0.0
    )
    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls


def _plan(serving: ChatServing, **body):
    return serving.tool_plan(ChatCompletionRequest(model=MODEL, messages=WEATHER_QUESTION,
                                                   **body))


def test_tool_choice_validation():
    plain = ChatServing(None, [MODEL])
    with pytest.raises(ValidationError, match="tool_choice"):
        _plan(plain, tool_choice="required")
    with pytest.raises(APIError, match="--enable-auto-tool-choice"):
        _plan(plain, tools=TOOLS)
    with pytest.raises(APIError, match="not in tools"):
        _plan(plain, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}})
    with pytest.raises(APIError, match="cannot be combined"):
        _plan(plain, tools=TOOLS, tool_choice="required", guided_regex="a")
    assert _plan(plain, tools=TOOLS, tool_choice="none") is None
    required = _plan(plain, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert required.constraint.json["maxItems"] == 1
    with pytest.raises(ValueError, match="unknown tool call parser"):
        ChatServing(None, [MODEL], tool_call_parser="mistral")
    hermes = ChatServing(None, [MODEL], tool_call_parser="hermes", enable_auto_tool_choice=True)
    assert isinstance(_plan(hermes, tools=TOOLS).parser, HermesToolParser)
