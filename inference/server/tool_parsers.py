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

Every parser offers ``stream()``: a ``ToolStream`` is fed each new piece of the output and
returns the content to send and the tool-call deltas (OpenAI's ``delta.tool_calls``
entries), as vLLM and OpenAI stream them: a call's first delta carries its index, id and
name (arguments ""), as soon as the name is complete; its arguments follow in fragments as
they are generated. The arguments are the model's own text of the arguments object, so the
fragments add up to exactly what ``parse(text) -> (content, calls)`` finds in the finished
output (it runs the same stream over the whole text). Text that could still turn into a call
(a partial ``<tool_call>``) is held back, never sent as content and then taken back.

A streamed call cannot be taken back either: once its name is out, a call cut short
(``max_tokens``) stands with the arguments generated so far, as OpenAI's own truncated calls
do (finish_reason "length"). ``parse`` sees the whole output, so there a cut-off call makes
the output plain text again.
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
        self.num_calls = 0  # calls sent so far: the next call's index
        self.cut_short = False  # a sent call whose object never closed (set by finish)

    def feed(self, text: str) -> StreamStep:
        raise NotImplementedError

    def finish(self) -> StreamStep:
        """The output ended: whatever was held back, as content or calls."""
        raise NotImplementedError

    def open_call(self, name: str) -> ToolCallDelta:
        delta = ToolCallDelta(self.num_calls, "", tool_call_id(), name)
        self.num_calls += 1
        return delta


class ToolParser:
    def stream(self) -> ToolStream:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, calls) of a finished output; content is None when empty. The calls are
        what streaming the same text sends; a call cut short makes it all content."""
        stream = self.stream()
        content, deltas = stream.feed(text)
        more_content, more_deltas = stream.finish()
        if stream.cut_short:
            return _content_or_none(text), []
        calls: list[ParsedToolCall] = []
        for delta in deltas + more_deltas:
            if delta.name is not None:
                calls.append(ParsedToolCall(delta.name, delta.arguments))
            else:
                calls[delta.index].arguments += delta.arguments
        if not calls:
            return _content_or_none(text), []
        return _content_or_none((content + more_content).strip()), calls


def _content_or_none(text: str) -> str | None:
    return text if text.strip() else None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


@dataclass
class _CallObject:
    """One ``{...}`` the reader found; a call once it has a string name."""

    index: int | None = None  # set when its first delta is sent
    name: str | None = None
    arguments_start: int | None = None  # an object or array: the model's text, streamed
    arguments_end: int | None = None
    arguments: str | None = None  # a string (decoded) or a scalar: sent once complete
    sent: int = 0  # characters of the arguments sent
    closed: bool = False


class _CallReader:
    """Finds tool-call objects ``{"name": ..., <arguments key>: ...}`` in JSON text fed a
    piece at a time, at one nesting depth (0: top-level objects; 1: the elements of a
    top-level array), and turns them into deltas for ``owner``: a call's first delta once
    its name is complete (before or after its arguments), then its arguments' text as it
    arrives. An object without a string name is not a call and sends nothing.

    A character at a time, tracking strings and nesting: the keys and values of the
    object's own level are all it needs to know. vLLM instead re-parses the whole prefix
    with a partial-JSON parser each step and sends the growth of ``json.dumps`` of the
    partial arguments, holding back what the completion may still change (a string's
    closing quote, a number's digits); sending the span of the model's own text needs
    neither, costs one pass over each new character and adds up exactly by construction."""

    def __init__(self, owner: ToolStream, depth: int, keys: tuple[str, ...]) -> None:
        self.owner = owner
        self.depth = depth
        self.keys = keys  # the argument keys, by preference
        self.text = ""
        self.level = 0
        self.in_string = False
        self.escaped = False
        self.objects: list[_CallObject] = []
        self.current: _CallObject | None = None
        self.key: str | None = None  # the key whose value is being read
        # what comes next at the object's level: key, colon, value, scalar (in a number or
        # literal), nested (in an object or array), arguments (the arguments object), comma
        self.expect = "key"
        self.token_start = 0

    @property
    def in_call_string(self) -> bool:
        """Within a JSON string inside an object (where a closing tag is just text)."""
        return self.in_string and self.current is not None

    def feed(self, text: str) -> list[ToolCallDelta]:
        base = len(self.text)
        self.text += text
        for offset, char in enumerate(text):
            self._read(base + offset, char)
        return self._deltas()

    def finish(self) -> list[ToolCallDelta]:
        if self.current is not None:
            self._end_scalar(len(self.text))
        deltas = self._deltas()
        if any(o.index is not None and not o.closed for o in self.objects):
            self.owner.cut_short = True
        return deltas

    @property
    def made_calls(self) -> bool:
        return any(o.index is not None for o in self.objects)

    def _read(self, i: int, char: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
                if self._at_object_level():
                    self._end_string(i)
            return
        at_level = self._at_object_level()
        if char == '"':
            self.in_string = True
            if at_level:
                self.token_start = i
        elif char in "{[":
            if at_level:
                self._start_nested(i)
            elif char == "{" and self.current is None and self.level == self.depth:
                self.current = _CallObject()
                self.objects.append(self.current)
                self.expect = "key"
            self.level += 1
        elif char in "}]":
            self.level = max(self.level - 1, 0)
            if self.current is None:
                return
            if self.level == self.depth + 1:
                self._end_nested(i + 1)
            elif self.level <= self.depth:  # the object closed
                self._end_scalar(i)
                self.current.closed = True
                self.current = None
        elif at_level:
            if char == ":" and self.expect == "colon":
                self.expect = "value"
            elif char == ",":
                self._end_scalar(i)
                self.expect = "key"
            elif self.expect == "value" and not char.isspace():
                self.token_start = i
                self.expect = "scalar"

    def _at_object_level(self) -> bool:
        return self.current is not None and self.level == self.depth + 1

    def _takes_arguments(self, obj: _CallObject) -> bool:
        return self.key in self.keys and obj.arguments_start is None and obj.arguments is None

    def _end_string(self, i: int) -> None:
        assert self.current is not None
        value = _loads(self.text[self.token_start : i + 1])
        if self.expect == "key":
            self.key = value if isinstance(value, str) else None
            self.expect = "colon"
        elif self.expect == "value":
            if self.key == "name" and self.current.name is None and isinstance(value, str):
                self.current.name = value
            elif self._takes_arguments(self.current) and isinstance(value, str):
                self.current.arguments = value  # arguments written as a JSON string
            self.expect = "comma"

    def _start_nested(self, i: int) -> None:
        assert self.current is not None
        if self.expect != "value":
            return
        if self._takes_arguments(self.current):
            self.current.arguments_start = i
            self.expect = "arguments"
        else:
            self.expect = "nested"

    def _end_nested(self, end: int) -> None:
        assert self.current is not None
        if self.expect == "arguments":
            self.current.arguments_end = end
        if self.expect in ("arguments", "nested"):
            self.expect = "comma"

    def _end_scalar(self, end: int) -> None:
        assert self.current is not None
        if self.expect == "scalar":
            if self._takes_arguments(self.current):
                self.current.arguments = self.text[self.token_start : end].strip()
            self.expect = "comma"

    def _deltas(self) -> list[ToolCallDelta]:
        deltas = []
        for obj in self.objects:
            if obj.index is None:
                if obj.name is None:
                    continue  # not a call (yet)
                opening = self.owner.open_call(obj.name)
                obj.index = opening.index
                deltas.append(opening)
            fragment = self._unsent_arguments(obj)
            if fragment:
                deltas.append(ToolCallDelta(obj.index, fragment))
        return deltas

    def _unsent_arguments(self, obj: _CallObject) -> str:
        if obj.arguments_start is not None:
            end = obj.arguments_end if obj.arguments_end is not None else len(self.text)
            fragment = self.text[obj.arguments_start + obj.sent : end]
        elif obj.arguments is not None:
            fragment = obj.arguments[obj.sent :]
        elif obj.closed and obj.sent == 0:
            fragment = "{}"  # a call without arguments
        else:
            return ""
        obj.sent += len(fragment)
        return fragment


# ----- hermes ----------------------------------------------------------------------------

_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"
_HERMES_KEYS = ("arguments", "parameters")


class HermesToolParser(ToolParser):
    def stream(self) -> ToolStream:
        return _HermesStream()


class _HermesStream(ToolStream):
    def __init__(self) -> None:
        super().__init__()
        self.buffer = ""  # text not yet read
        self.reader: _CallReader | None = None  # within <tool_call> ... </tool_call>

    def feed(self, text: str) -> StreamStep:
        self.buffer += text
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while True:
            if self.reader is None:
                start = self.buffer.find(_HERMES_START)
                if start < 0:
                    keep = _partial_suffix(self.buffer, _HERMES_START)
                    content.append(self._take(len(self.buffer) - keep))
                    break
                content.append(self._take(start))
                self._take(len(_HERMES_START))
                self.reader = _CallReader(self, 0, _HERMES_KEYS)
                continue
            end = self.buffer.find(_HERMES_END)
            if end < 0:
                keep = _partial_suffix(self.buffer, _HERMES_END)
                calls += self.reader.feed(self._take(len(self.buffer) - keep))
                break
            calls += self.reader.feed(self._take(end))
            tag = self._take(len(_HERMES_END))
            if self.reader.in_call_string:
                calls += self.reader.feed(tag)  # the tag is text within an argument
            else:
                self._close(content, calls, closed=True)
        return "".join(content), calls

    def finish(self) -> StreamStep:
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        if self.reader is not None:
            calls += self.reader.feed(self._take(len(self.buffer)))
            self._close(content, calls, closed=False)
        content.append(self._take(len(self.buffer)))
        return "".join(content), calls

    def _take(self, size: int) -> str:
        taken, self.buffer = self.buffer[:size], self.buffer[size:]
        return taken

    def _close(self, content: list[str], calls: list[ToolCallDelta], closed: bool) -> None:
        assert self.reader is not None
        reader, self.reader = self.reader, None
        calls += reader.finish()
        if not reader.made_calls:  # not a call after all: the text as written
            content.append(_HERMES_START + reader.text + (_HERMES_END if closed else ""))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (it may be completed)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


# ----- JSON objects: llama3_json and tool_choice "required" ------------------------------

_LLAMA_TAG = "<|python_tag|>"
_LLAMA_KEYS = ("parameters", "arguments")


class Llama3JsonToolParser(ToolParser):
    def stream(self) -> ToolStream:
        return _ObjectStream(0, _LLAMA_KEYS, decide_by_first_char=True)


class RequiredToolParser(ToolParser):
    """The output forced by ``tool_choice: "required"``: ``[{"name", "parameters"}, ...]``."""

    def stream(self) -> ToolStream:
        return _ObjectStream(1, ("parameters",), decide_by_first_char=False)


class _ObjectStream(ToolStream):
    def __init__(self, depth: int, keys: tuple[str, ...], decide_by_first_char: bool) -> None:
        super().__init__()
        self.reader = _CallReader(self, depth, keys)
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
        return "", self.reader.feed(text)

    def finish(self) -> StreamStep:
        if self.mode != "calls":
            return self.pending, []
        calls = self.reader.finish()
        if self.num_calls == 0:
            return self.reader.text, []  # nothing was a call: the text was content after all
        return "", calls


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
        opening = [self.open_call(self.name)] if self.num_calls == 0 else []
        return "", [*opening, ToolCallDelta(0, text)]

    def finish(self) -> StreamStep:
        if self.num_calls == 0:  # no argument text at all: still one call
            return "", [self.open_call(self.name)]
        return "", []


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}
