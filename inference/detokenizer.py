"""Incremental detokenization: text grows token by token without re-decoding the whole
output each step, and never emits half of a multi-byte character."""

from __future__ import annotations

# Tokens of prompt context decoded along with the first outputs, so tokenizers that mark
# word starts (sentencepiece's "▁") render the first output's leading space correctly.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self.tokens.append(token_id)
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            self.text += delta
            return delta
        return ""
