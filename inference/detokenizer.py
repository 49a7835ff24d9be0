"""Incremental detokenization: text grows token by token without re-decoding the whole
output each step, and never emits half of a multi-byte character.

The algorithm (vLLM's): keep a window of tokens ``[prefix_offset:]`` and decode it twice,
with and without the tokens not yet rendered (``[read_offset:]``); the difference is the new
text, emitted only once it no longer ends in a replacement character. The `tokenizers`
library runs the same algorithm in Rust (``tokenizers.decoders.DecodeStream``, ~1.5 us a
token against ~10 us through ``tokenizer.decode`` twice), so a fast tokenizer whose
``decode`` is its backend's plain decode uses that; anything else (slow tokenizers,
tokenizers that clean up spaces after decoding, a prompt ending inside a character) takes
the Python path. Both produce the same text.
"""

from __future__ import annotations

from typing import Any

# Tokens of prompt context decoded along with the first outputs, so tokenizers that mark
# word starts (sentencepiece's "▁") render the first output's leading space correctly.
CONTEXT_TOKENS = 6
_REPLACEMENT = "\ufffd"

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - tokenizers is a dependency; keep a fallback
    DecodeStream = None


def _stream_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer whose decode equals ``tokenizer.decode``, or None."""
    if DecodeStream is None or not getattr(tokenizer, "is_fast", False):
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(
        tokenizer, "_tokenizer", None
    )
    if backend is None or not hasattr(backend, "decode"):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        # transformers >= 5 skips the clean-up for BPE models (it corrupts their output),
        # and says so with this flag; older versions always clean up: then DecodeStream's
        # raw text would differ from decode()'s.
        forced = getattr(
            tokenizer,
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
            None,
        )
        is_bpe = type(getattr(backend, "model", None)).__name__ == "BPE"
        if forced is None or forced or not is_bpe:
            return None
    return backend


class IncrementalDetokenizer:
    __slots__ = (
        "tokenizer", "skip_special_tokens", "tokens", "prefix_offset", "read_offset", "text",
        "_backend", "_stream",
    )  # fmt: skip

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        *,
        use_decode_stream: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        self._backend = _stream_backend(tokenizer) if use_decode_stream else None
        self._stream = None
        if self._backend is not None:
            context = self.tokens
            # DecodeStream only adopts a context that decodes to whole characters; otherwise
            # it would emit the context itself with the first token.
            if not context or not self._decode(context).endswith(_REPLACEMENT):
                self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self.tokens.append(token_id)
        stream = self._stream
        if stream is not None:
            try:
                delta = stream.step(self._backend, token_id)
            except Exception:  # noqa: BLE001 - its prefix check failed: finish in Python
                self._stream = None
                return self._add_python()
            if delta is None:
                return ""
            # Mirror the stream's window, so the Python path can take over at any point.
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            self.text += delta
            return delta
        return self._add_python()

    def _add_python(self) -> str:
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT):
            delta = full_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            self.text += delta
            return delta
        return ""
