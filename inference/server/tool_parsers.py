"""Tool calls in a chat model's output: parsed whole, or as the output streams.

Which format a model writes its calls in depends on how it was trained, so the server is
told (``--tool-call-parser``, vLLM's names):

  ``hermes``       Hermes and Qwen2/2.5/3: ``<tool_call>{"name": ..., "arguments": {...}}
                   </tool_call>`` blocks, possibly after some text;
  ``llama3_json``  Llama 3.x: the whole answer is ``{"name": ..., "parameters": {...}}``
                   (several separated by ``;``), optionally after ``<|python_tag|>``.

With ``tool_choice: "required"`` or a named function the output is forced by the grammar
engine instead, and its shape is ours: a JSON array of ``{"name", "parameters"}`` objects
(``RequiredToolParser``), or the named function's arguments object (``NamedToolParser``).

Every parser offers ``parse(text) -> (content, calls)`` for a finished output and
``stream()`` for a streamed one: a ``ToolStream`` is fed each new piece of text and
returns the content to send and the tool-call deltas (OpenAI's ``delta.tool_calls``
entries). A call is sent once it is complete (its closing tag or brace has arrived) with its
whole arguments; a named function's arguments stream as they are generated. Text that
could still turn into a call is held back, never sent as content and then taken back.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text

    def to_openai(self, call_id: str | None = None) -> dict[str, Any]:
        return {
            "id": call_id or tool_call_id(),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ToolCallDelta:
    """One entry of a streamed chunk's ``delta.tool_calls``."""

    index: int
    arguments: str
    id: str | None = None  # set, with name, on a call's first delta
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {}
        if self.id is not None:
            entry["id"] = self.id
            entry["type"] = "function"
            function["name"] = self.name
        function["arguments"] = self.arguments
        entry["function"] = function
        return entry


StreamStep = tuple[str, list[ToolCallDelta]]  # (content to send, tool-call deltas)


class ToolStream:
    """Streaming state of one choice; subclasses implement ``feed`` and ``finish``."""

    def __init__(self) -> None:
        self.num_calls = 0

    def feed(self, text: str) -> StreamStep:
        raise NotImplementedError

    def finish(self) -> StreamStep:
        """The output ended: whatever was held back, as content or calls."""
        raise NotImplementedError

    def _whole_call(self, call: ParsedToolCall) -> ToolCallDelta:
        delta = ToolCallDelta(self.num_calls, call.arguments, tool_call_id(), call.name)
        self.num_calls += 1
        return delta


class ToolParser:
    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, calls) of a finished output; content is None when empty."""
        raise NotImplementedError

    def stream(self) -> ToolStream:
        raise NotImplementedError


def _call_from_object(obj: Any, argument_keys: tuple[str, ...]) -> ParsedToolCall:
    """A call from ``{"name": ..., <argument key>: {...}}``; ValueError otherwise."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a tool call must be an object with a string name")
    arguments: Any = {}
    for key in argument_keys:
        if key in obj:
            arguments = obj[key]
            break
    if isinstance(arguments, str):
        return ParsedToolCall(obj["name"], arguments)
    return ParsedToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _content_or_none(text: str) -> str | None:
    return text if text.strip() else None


# ----- hermes ----------------------------------------------------------------------------

_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"
_HERMES_KEYS = ("arguments", "parameters")


class HermesToolParser(ToolParser):
    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        if _HERMES_START not in text:
            return _content_or_none(text), []
        content, calls = [], []
        rest = text
        try:
            while True:
                start = rest.find(_HERMES_START)
                if start < 0:
                    content.append(rest)
                    break
                content.append(rest[:start])
                rest = rest[start + len(_HERMES_START) :]
                end = rest.find(_HERMES_END)
                body, rest = (rest, "") if end < 0 else (rest[:end], rest[end + len(_HERMES_END) :])
                calls.append(_call_from_object(json.loads(body), _HERMES_KEYS))
        except ValueError:
            return _content_or_none(text), []  # not calls after all: the text as written
        return _content_or_none("".join(content).strip()), calls

    def stream(self) -> ToolStream:
        return _HermesStream()


class _HermesStream(ToolStream):
    def __init__(self) -> None:
        super().__init__()
        self.buffer = ""  # text not yet sent
        self.inside = False  # within <tool_call> ... </tool_call>

    def feed(self, text: str) -> StreamStep:
        self.buffer += text
        content, calls = [], []
        while True:
            if not self.inside:
                start = self.buffer.find(_HERMES_START)
                if start < 0:
                    keep = _partial_suffix(self.buffer, _HERMES_START)
                    content.append(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                content.append(self.buffer[:start])
                self.buffer = self.buffer[start + len(_HERMES_START) :]
                self.inside = True
            else:
                end = self.buffer.find(_HERMES_END)
                if end < 0:
                    break
                body = self.buffer[:end]
                self.buffer = self.buffer[end + len(_HERMES_END) :]
                self.inside = False
                self._emit(body, content, calls, closed=True)
        return "".join(content), calls

    def finish(self) -> StreamStep:
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        if self.inside:
            self._emit(self.buffer, content, calls, closed=False)
        else:
            content.append(self.buffer)
        self.buffer, self.inside = "", False
        return "".join(content), calls

    def _emit(self, body: str, content: list[str], calls: list[ToolCallDelta], closed: bool):
        try:
            calls.append(self._whole_call(_call_from_object(json.loads(body), _HERMES_KEYS)))
        except ValueError:
            content.append(_HERMES_START + body + (_HERMES_END if closed else ""))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (it may be completed)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


# ----- JSON objects: llama3_json and tool_choice "required" ------------------------------

class _JsonScanner:
    """Finds where JSON objects at a given nesting depth end, fed a piece at a time."""

    def __init__(self, depth: int) -> None:
        self.depth = depth  # 0: top-level objects; 1: the elements of a top-level array
        self.level = 0
        self.in_string = False
        self.escaped = False
        self.text = ""
        self.start: int | None = None

    def feed(self, text: str) -> list[str]:
        """The objects at ``depth`` that this piece completes, as text."""
        done = []
        base = len(self.text)
        self.text += text
        for offset, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                continue
            if char == '"':
                self.in_string = True
            elif char in "{[":
                if char == "{" and self.level == self.depth:
                    self.start = base + offset
                self.level += 1
            elif char in "}]":
                self.level -= 1
                if char == "}" and self.level == self.depth and self.start is not None:
                    done.append(self.text[self.start : base + offset + 1])
                    self.start = None
        return done


_LLAMA_TAG = "<|python_tag|>"
_LLAMA_KEYS = ("parameters", "arguments")


class Llama3JsonToolParser(ToolParser):
    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        body = text.strip().removeprefix(_LLAMA_TAG).lstrip()
        if not body.startswith("{"):
            return _content_or_none(text), []
        decoder = json.JSONDecoder()
        calls, position = [], 0
        try:
            while position < len(body):
                obj, position = decoder.raw_decode(body, position)
                calls.append(_call_from_object(obj, _LLAMA_KEYS))
                while position < len(body) and body[position] in " \t\r\n;":
                    position += 1
        except ValueError:
            return _content_or_none(text), []
        return None, calls

    def stream(self) -> ToolStream:
        return _ObjectStream(_JsonScanner(0), _LLAMA_KEYS, decide_by_first_char=True)


class RequiredToolParser(ToolParser):
    """The output forced by ``tool_choice: "required"``: ``[{"name", "parameters"}, ...]``."""

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        try:
            items = json.loads(text)
            if not isinstance(items, list):
                raise ValueError("not a list")
            return None, [_call_from_object(item, ("parameters",)) for item in items]
        except ValueError:
            return _content_or_none(text), []  # cut short (max_tokens): hand back the text

    def stream(self) -> ToolStream:
        return _ObjectStream(_JsonScanner(1), ("parameters",), decide_by_first_char=False)


class _ObjectStream(ToolStream):
    def __init__(
        self, scanner: _JsonScanner, keys: tuple[str, ...], decide_by_first_char: bool
    ) -> None:
        super().__init__()
        self.scanner = scanner
        self.keys = keys
        # llama3_json: the first visible character says whether this is a call at all.
        self.mode: str | None = None if decide_by_first_char else "calls"
        self.pending = ""  # leading whitespace before the decision

    def feed(self, text: str) -> StreamStep:
        if self.mode is None:
            self.pending += text
            head = self.pending.lstrip()
            if not head:
                return "", []
            is_call = head.startswith("{") or head.startswith(_LLAMA_TAG[: len(head)])
            self.mode = "calls" if is_call else "content"
            text, self.pending = self.pending, ""
        if self.mode == "content":
            return text, []
        calls = []
        for body in self.scanner.feed(text):
            try:
                calls.append(self._whole_call(_call_from_object(json.loads(body), self.keys)))
            except ValueError:
                continue  # not a call object (never with a grammar-forced output)
        return "", calls

    def finish(self) -> StreamStep:
        if self.mode == "calls" and self.num_calls == 0:
            # Nothing parsed as a call: the text was content after all.
            return self.scanner.text, []
        return self.pending, []


class NamedToolParser(ToolParser):
    """The output forced by a named ``tool_choice``: that function's arguments."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        return None, [ParsedToolCall(self.name, text)]

    def stream(self) -> ToolStream:
        return _NamedStream(self.name)


class _NamedStream(ToolStream):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> StreamStep:
        if not text:
            return "", []
        if self.num_calls == 0:
            return "", [self._whole_call(ParsedToolCall(self.name, text))]
        return "", [ToolCallDelta(0, text)]

    def finish(self) -> StreamStep:
        if self.num_calls == 0:  # no argument text at all: still one call
            return "", [self._whole_call(ParsedToolCall(self.name, ""))]
        return "", []


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}
