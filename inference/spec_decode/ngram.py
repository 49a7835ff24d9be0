"""N-gram prompt lookup: guess a sequence's next tokens from its own history.

Copy-heavy work (summaries quoting their source, code edits, retrieval answers, chat that
repeats the user's words) continues text that already appeared. For a sequence whose
tokens end in ``t[-n:]``, find the most recent earlier place those ``n`` tokens occur in
its prompt + output and propose the ``k`` tokens that followed there; try the longest
``n`` first (``prompt_lookup_max`` down to ``prompt_lookup_min``), as a longer match
predicts better. A match too close to the end to have ``k`` tokens after it (text that
repeats a short period: the last occurrence is one period back) gives way to the most
recent one that has them, which proposes the same tokens, only more of them. No model
runs: a proposal costs one vectorised scan of the history.

Each sequence's history is kept as a growing numpy array (``TokenHistory``), appended with
only the tokens that arrived since the last proposal, so a step copies no whole prompts.
"""

from __future__ import annotations

import numpy as np


class TokenHistory:
    """A sequence's known tokens as an int64 array that grows in place (amortised: the
    buffer doubles), filled from ``token_ids`` with only what is new."""

    __slots__ = ("_buffer", "length")

    def __init__(self) -> None:
        self._buffer = np.empty(64, dtype=np.int64)
        self.length = 0

    def sync(self, token_ids: list[int], num_known: int) -> np.ndarray:
        """The first ``num_known`` of ``token_ids`` (which only ever grow at the end)."""
        if num_known < self.length:  # cannot happen for known tokens; stay correct anyway
            self.length = 0
        if num_known > len(self._buffer):
            grown = np.empty(max(num_known, 2 * len(self._buffer)), dtype=np.int64)
            grown[: self.length] = self._buffer[: self.length]
            self._buffer = grown
        if num_known > self.length:
            self._buffer[self.length : num_known] = token_ids[self.length : num_known]
            self.length = num_known
        return self._buffer[: self.length]


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(
        self, tokens: np.ndarray, max_drafts: int | None = None, lookahead: int = 0
    ) -> list[int]:
        """Up to ``k + lookahead`` (and ``max_drafts``) tokens that followed the most recent
        earlier occurrence of the longest matching suffix of ``tokens``; [] when none
        matches."""
        k = self.num_speculative_tokens + lookahead
        if max_drafts is not None:
            k = min(max_drafts, k)
        length = len(tokens)
        if k <= 0 or length < self.min_n + 1:
            return []
        last = tokens[-1]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = _most_recent_match(tokens, n, last, k)
            if start is not None:
                return tokens[start + n : start + n + k].tolist()
        return []


def _most_recent_match(tokens: np.ndarray, n: int, last: np.int64, k: int) -> int | None:
    """The largest start ``i < len(tokens) - n`` with ``tokens[i:i+n] == tokens[-n:]`` and
    ``k`` tokens after the match, else the largest such start. Candidates are first
    narrowed to where the suffix's last token occurs, so the scan is one comparison per
    token plus ``n`` per candidate."""
    length = len(tokens)
    # Window starting at i ends at i + n - 1 <= length - 2: strictly before the suffix.
    starts = np.flatnonzero(tokens[n - 1 : length - 1] == last)  # = window starts
    if starts.size and n > 1:
        suffix = tokens[length - n : length - 1]
        offsets = starts[:, None] + np.arange(n - 1)
        starts = starts[(tokens[offsets] == suffix).all(axis=1)]
    if starts.size == 0:
        return None
    full = starts[starts + n + k <= length]  # a continuation of k tokens
    return int(full[-1] if full.size else starts[-1])
