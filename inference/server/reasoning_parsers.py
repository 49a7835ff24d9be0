"""``--reasoning-parser``: a thinking model's reasoning, returned apart from its answer.

Chat completions then carry the text between ``<think>`` and ``</think>`` in
``message.reasoning_content`` (streamed as ``delta.reasoning_content``) and only what follows
in ``content``, with the semantics of vLLM's parsers of the same names:

- ``deepseek_r1``: the chat template may end the prompt with ``<think>``, so the output need
  not open with it; everything up to ``</think>`` is reasoning (all of it when the output
  stops before ``</think>``), a leading ``<think>`` is dropped.
- ``qwen3``: reasoning only when the output opens a ``<think>`` block (an output without
  one is all content, as with ``enable_thinking: false``); an unclosed block is reasoning.

Tool calls are parsed from the content only. Tags are matched as text, so a tag split over
two streamed deltas is held back until it is complete.
"""

from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (held back)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningStream:
    """Splits one choice's streamed text into (reasoning, content) deltas."""

    def __init__(self, implicit_start: bool) -> None:
        # "start": before the output has shown whether it opens with <think>
        self.state = "start"
        self.implicit_start = implicit_start
        self.opened = False  # the output opened a <think> block
        self.buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning, content = [], []
        while self.buffer:
            if self.state == "start":
                stripped = self.buffer.lstrip()
                if stripped.startswith(THINK_START):
                    self.buffer = stripped[len(THINK_START):]
                    self.state = "reasoning"
                    self.opened = True
                elif THINK_START.startswith(stripped):
                    break  # "<thi" so far: wait for more
                else:
                    self.state = "reasoning" if self.implicit_start else "content"
            elif self.state == "reasoning":
                end = self.buffer.find(THINK_END)
                if end < 0:
                    keep = _partial_suffix(self.buffer, THINK_END)
                    reasoning.append(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                reasoning.append(self.buffer[:end])
                self.buffer = self.buffer[end + len(THINK_END):]
                self.state = "content"
            else:
                content.append(self.buffer)
                self.buffer = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is held back once the output is complete."""
        rest, self.buffer = self.buffer, ""
        if self.state == "reasoning" or (self.state == "start" and self.implicit_start):
            return rest, ""
        return "", rest


class ReasoningParser:
    implicit_start = False

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.implicit_start)

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """A finished output's (reasoning, content); None where there is none."""
        stream = self.stream()
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        reasoning, content = reasoning + more_reasoning, content + more_content
        if not stream.opened and not self.implicit_start:
            return None, text  # no <think> block: the text as it is
        return reasoning or None, content or None


class DeepSeekR1ReasoningParser(ReasoningParser):
    implicit_start = True


class Qwen3ReasoningParser(ReasoningParser):
    implicit_start = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}
