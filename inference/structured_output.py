"""Structured outputs: the grammar engine (llguidance) behind constrained decoding.

A constrained request's output must stay inside a grammar: a JSON schema, any JSON object,
a regex, a choice of strings, or a Lark/GBNF grammar. llguidance turns each into a matcher
that, given the tokens accepted so far, says which tokens may come next as a bitmask over
the vocabulary (bit ``t % 32`` of word ``t // 32``), which the sampler applies to the
logits of the constrained rows only.

Off the engine's critical path:
  * checking a schema or grammar (``GrammarCompiler.check``) is a parse without the
    tokenizer, a millisecond or so, cached by key; it runs in ``add_request`` so that a
    bad schema is a ``ValueError`` (a 400) and never reaches the scheduler;
  * building the matcher against the tokenizer (and, once, llguidance's view of the
    tokenizer, about a second for a large vocabulary) runs in a thread pool; the request
    waits outside the scheduler until its future is done (``LLMEngine``). Matchers are
    cached by the constraint's key, several independent ones a constraint
    (``MatcherTemplates``), and each sequence gets a cheap copy of one of them;
  * the per-step masks of all constrained rows are filled by llguidance's own thread pool
    with the GIL released (``fill_bitmask``); rows copied from different templates fill in
    parallel.

Constrained rows keep async scheduling: the mask for step n+1 needs step n's tokens, but
the forward pass of step n+1 does not. Once step n is launched (on one device), a thread
of the engine's waits for its tokens, advances the matchers by them (``advance``, once per
step) and fills their next masks, while the engine thread (having completed step n-1)
hands out outputs and schedules and queues step n+1's forward pass; step n+1's sampler then takes the masks
(rows the batch gained meanwhile are filled then). So on a GPU the grammar work overlaps
both the host's other work and the forward pass. Under tensor parallelism the fill runs
inside the launch, after the forward pass has been queued. A matcher has consumed exactly
its sequence's resolved output tokens. Preemption keeps a sequence's tokens, so its
matcher stays valid through recomputation.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence as SequenceABC
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from inference.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Distinct constraints whose matchers stay cached (a service usually sees a few schemas).
_CACHE_SIZE = 256
# Threads that build matchers: building is seldom long, but one huge grammar must not
# hold up every other constrained request.
_COMPILE_THREADS = 2
# Further templates are built before the request goes on when that takes at most this.
_INLINE_TEMPLATES_S = 0.05
# llguidance's threads for the batched mask fills: half the CPUs, up to 8 (the rest stay
# with the engine thread, the tokenizers and the tensor-parallel workers).
FILL_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))


class MatcherTemplates:
    """One constraint's matchers that sequences are cloned from, in turn. Clones of one
    matcher share its lexer cache behind one lock, so rows cloned from a single template
    fill their masks one after another however many threads fill; several independent
    templates let rows of one schema fill in parallel (H200 host, 64 JSON-schema rows:
    4.3 ms a step from one template, 1.0 from 16 with 12 threads; 256 rows: 15.1 -> 3.5).
    The first template is built before the request is scheduled, the others in the
    background."""

    def __init__(self, first: Any) -> None:
        self._templates = [first]
        self._turn = 0

    def add(self, template: Any) -> None:
        self._templates.append(template)

    def __len__(self) -> int:
        return len(self._templates)

    def deep_copy(self) -> Any:
        """A fresh matcher for one sequence, from the next template in turn."""
        templates = self._templates
        self._turn += 1
        return templates[self._turn % len(templates)].deep_copy()


def ascii_digits(regex: str) -> str:
    """``regex`` with ``\\d`` as ``[0-9]`` (and ``\\D`` as ``[^0-9]``): what JSON Schema
    patterns and most users mean, where the regex engine's ``\\d`` also admits every
    Unicode digit ("٣")."""
    out, i, in_class = [], 0, False
    while i < len(regex):
        char = regex[i]
        if char == "\\" and i + 1 < len(regex):
            escaped = regex[i + 1]
            if escaped == "d":
                out.append("0-9" if in_class else "[0-9]")
            elif escaped == "D" and not in_class:
                out.append("[^0-9]")
            else:
                out.append(char + escaped)
            i += 2
            continue
        if char == "[" and not in_class:
            in_class = True
        elif char == "]" and in_class:
            in_class = False
        out.append(char)
        i += 1
    return "".join(out)


def _ascii_digit_patterns(schema: Any) -> Any:
    """A JSON schema with every ``pattern`` string passed through ``ascii_digits``."""
    if isinstance(schema, dict):
        return {
            key: ascii_digits(value) if key == "pattern" and isinstance(value, str)
            else _ascii_digit_patterns(value)
            for key, value in schema.items()
        }  # fmt: skip
    if isinstance(schema, list):
        return [_ascii_digit_patterns(item) for item in schema]
    return schema


def grammar_source(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar text for ``spec``; raises ValueError, naming the constraint,
    when the schema, regex or grammar is invalid."""
    import llguidance

    kind = spec.kinds()[0]
    options = {"whitespace_flexible": not spec.disable_any_whitespace}
    try:
        if kind == "json":
            schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
            schema = json.dumps(_ascii_digit_patterns(schema))
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        elif kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                '{"type": "object"}', defaults=options
            )
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(ascii_digits(spec.regex or ""))
        elif kind == "choice":
            # JSON string literals are valid Lark literals, escapes included.
            lark = "start: " + " | ".join(json.dumps(c) for c in spec.choice or [])
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        else:
            # Lark as llguidance reads it, or llama.cpp's GBNF (converted to Lark).
            grammar = llguidance.grammar_from("grammar", spec.grammar or "")
    except Exception as exc:  # noqa: BLE001 - whatever the parser raises, the input is bad
        raise ValueError(f"invalid structured output {_NAMES[kind]}: {exc}") from None
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except Exception as exc:  # noqa: BLE001
        error = str(exc) or type(exc).__name__
    if error:
        raise ValueError(f"invalid structured output {_NAMES[kind]}: {error.strip()}")
    return grammar


_NAMES = {
    "json": "JSON schema", "json_object": "JSON object", "regex": "regex",
    "choice": "choice", "grammar": "grammar",
}  # fmt: skip


class GrammarCompiler:
    """Builds and caches matchers for one tokenizer; fills the batched bitmask."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], pinned: bool = False
    ) -> None:
        """``pinned``: fill masks in page-locked memory (the sampler copies them to a GPU
        as they are, with no staging copy)."""
        # The mask spans the model's vocabulary (often padded past the tokenizer's) or the
        # tokenizer's, whichever is larger; the sampler cuts it to the logits' width.
        self.vocab_size = max(vocab_size, len(tokenizer)) if tokenizer is not None else vocab_size
        self.num_words = (self.vocab_size + 31) // 32
        self._hf_tokenizer = tokenizer
        self._eos_token_ids = list(eos_token_ids)
        self._pinned = pinned
        self._pool = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="grammar")
        # Builds a constraint's further templates, after its first: never ahead of another
        # request's first.
        self._more = ThreadPoolExecutor(1, thread_name_prefix="grammar-templates")
        self._lock = threading.Lock()
        self._tokenizer: Future | None = None  # llguidance's tokenizer, built once
        self._sources: OrderedDict[tuple, str] = OrderedDict()  # checked grammar texts
        self._cache: OrderedDict[tuple, Future] = OrderedDict()  # matcher templates
        self._executor: Any = None  # llguidance's thread pool for batched mask fills
        # Its threads, set before the first fill; None: llguidance's default (80 % of the
        # CPUs). Each constraint gets twice as many templates (``MatcherTemplates``), one
        # with one thread: then its rows share one lexer cache.
        self.fill_threads: int | None = FILL_THREADS

    def check(self, spec: StructuredOutputsParams) -> str:
        """Validate ``spec`` (ValueError if invalid); returns its grammar text. A
        constraint already seen costs a dictionary look-up."""
        if self._hf_tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, which it lacks")
        key = spec.key()
        with self._lock:
            source = self._sources.get(key)
            if source is not None:
                self._sources.move_to_end(key)
                return source
        source = grammar_source(spec)
        with self._lock:
            self._sources[key] = source
            while len(self._sources) > _CACHE_SIZE:
                self._sources.popitem(last=False)
        return source

    def prepare(self) -> None:
        """Start building llguidance's view of the tokenizer in the background (the
        server does, once ready), so that the first constrained request does not wait
        for it."""
        with self._lock:
            if self._tokenizer is None and self._hf_tokenizer is not None:
                self._tokenizer = self._pool.submit(self._build_tokenizer)

    def matcher(self, spec: StructuredOutputsParams, grammar: str) -> Future:
        """A future of ``spec``'s ``MatcherTemplates`` (``deep_copy()`` per sequence)."""
        key = spec.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception()):
                self._cache.move_to_end(key)
                return future
            if self._tokenizer is None:
                self._tokenizer = self._pool.submit(self._build_tokenizer)
            future = self._pool.submit(self._build_matcher, grammar)
            self._cache[key] = future
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def _build_tokenizer(self) -> Any:
        import llguidance.hf

        # Stop ids the tokenizer does not have (a model config's, say) cannot end a
        # grammar; without any, llguidance takes the tokenizer's own EOS.
        size = len(self._hf_tokenizer)
        eos = [t for t in self._eos_token_ids if t < size] or None
        return llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos)

    def templates_per_constraint(self) -> int:
        threads = self.fill_threads or os.cpu_count() or 1
        return 1 if threads == 1 else 2 * threads

    def _build_matcher(self, grammar: str) -> MatcherTemplates:
        import llguidance

        assert self._tokenizer is not None
        tokenizer = self._tokenizer.result()
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid structured output: {matcher.get_error()}")
        templates = MatcherTemplates(matcher)
        more = self.templates_per_constraint() - 1
        # Cheap ones (a JSON schema: about a millisecond each) are all there before the
        # first sequence is copied; a grammar slow to build does not hold its request up.
        inline = (time.perf_counter() - start) * more <= _INLINE_TEMPLATES_S

        def another() -> None:
            templates.add(llguidance.LLMatcher(tokenizer, grammar, log_level=0))

        for _ in range(more):
            another() if inline else self._more.submit(another)
        return templates

    def fill_bitmask(self, matchers: SequenceABC[Any]) -> np.ndarray:
        """[len(matchers), words] int32: each matcher's allowed next tokens. Releases the
        GIL while llguidance computes (in parallel for more than one row)."""
        import llguidance.numpy as llg_numpy

        bitmask = self._empty_bitmask(len(matchers))
        if len(matchers) == 1:
            llg_numpy.fill_next_token_bitmask(matchers[0], bitmask, 0)
            return bitmask
        llg_numpy.fill_next_token_bitmask_par(
            self._llg_executor(), [(m, row) for row, m in enumerate(matchers)], bitmask
        )
        return bitmask

    def _empty_bitmask(self, rows: int) -> np.ndarray:
        if not self._pinned:
            return np.empty((rows, self.num_words), dtype=np.int32)
        # The array keeps its tensor, and with it the block, alive; the caching host
        # allocator reuses a block only once the copies queued from it are done.
        return torch.empty((rows, self.num_words), dtype=torch.int32, pin_memory=True).numpy()

    def advance(self, matchers: SequenceABC[Any], token_ids: SequenceABC[int]) -> list[bool]:
        """Advance each sequence's matcher by its new token; per matcher, True once the
        grammar admits no more tokens (the output is complete). One matcher after the
        other in this thread: a token costs about a microsecond, and llguidance's parallel
        executor only adds its dispatch (on the H200's host, 64 rows: 0.43 ms against
        0.10; 256 rows: 1.19 against 0.41)."""
        accepted = [m.consume_token(t) for m, t in zip(matchers, token_ids, strict=True)]
        ended = []
        for matcher, token_id, ok in zip(matchers, token_ids, accepted):
            if not ok:
                # Only a sampler bug could pick a masked token; never return unchecked output.
                logger.error("token %d rejected by the grammar: %s", token_id, matcher.get_error())
            ended.append(not ok or matcher.is_stopped())
        return ended

    def _llg_executor(self) -> Any:
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(self.fill_threads)
        return self._executor

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._more.shutdown(wait=False, cancel_futures=True)
