"""A copy-heavy workload for the benches (``--workload copy``): where speculative decoding
by prompt lookup pays.

Each prompt holds a document of about ``--document-len`` tokens (sentences drawn, seeded,
from a fixed word list), asks for it to be copied, and ends with the document's opening
words again, so a model that copies (as an instruction-tuned one does, and as induction
heads do) continues the document. A model without a tokenizer that knows the words gets
token ids: a random document followed by its own first tokens.

What a model actually copies is measured, not assumed: the **copy rate** is the share of
output tokens that continue a 4-gram of the prompt (the output token and the three before
it, across the prompt/output boundary, occur together in the prompt). The benches report
it beside the acceptance rate; random weights copy little, whatever the prompt, so with a
named shape the rate says what the speculative numbers were measured at.
"""

from __future__ import annotations

import numpy as np

COPY_NGRAM = 4
# Restated at the end of the prompt: the model's output then starts inside the document.
_RESTATED_TOKENS = 16
# Prompt tokens beyond the document: the instruction, a chat template, the restated start.
PROMPT_OVERHEAD_TOKENS = 128
_WORDS = (
    "the river harbour council market engine winter summer north south bridge station "
    "library garden report budget village teacher doctor farmer builder ledger signal "
    "lantern orchard meadow valley tower canal school museum quarry forest "
    "opened closed measured counted repaired painted carried recorded approved delayed "
    "early late quiet busy narrow wide old new small large first second third final"
).split()
_INSTRUCTION = "Copy the following document exactly, word for word.\n\n"
_ANSWER = "\n\nThe document, copied exactly:\n"


def copy_prompts(
    tokenizer, num: int, document_len: int, vocab_size: int, seed: int = 0
) -> list[list[int]]:
    """``num`` prompts, each with its own document of about ``document_len`` tokens."""
    rng = np.random.default_rng(seed)
    if tokenizer is None or not _knows_the_words(tokenizer):
        return [_id_prompt(rng, document_len, vocab_size) for _ in range(num)]
    return [_text_prompt(tokenizer, rng, document_len) for _ in range(num)]


def _knows_the_words(tokenizer) -> bool:
    """Whether the tokenizer spells the word list without unknown tokens (the named
    shapes' synthetic tokenizer knows only ``w<id>``: such models get token ids)."""
    ids = tokenizer(" ".join(_WORDS), add_special_tokens=False).input_ids
    return bool(ids) and getattr(tokenizer, "unk_token_id", None) not in ids


def _id_prompt(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    low = 1000 if vocab_size > 4000 else 3
    document = rng.integers(low, vocab_size - low, size=length).tolist()
    return document + document[:_RESTATED_TOKENS]


def _text_prompt(tokenizer, rng: np.random.Generator, length: int) -> list[int]:
    sentences: list[str] = []
    num_tokens = 0
    while num_tokens < length:
        # A batch of sentences at a time: tokenizing the growing document once per batch.
        for _ in range(max(1, (length - num_tokens) // 12)):
            words = rng.choice(_WORDS, size=int(rng.integers(6, 14))).tolist()
            sentences.append(" ".join(words).capitalize() + ".")
        num_tokens = len(tokenizer(" ".join(sentences)).input_ids)
    while len(sentences) > 1 and num_tokens > length:  # no more than asked for
        sentences.pop()
        num_tokens = len(tokenizer(" ".join(sentences)).input_ids)
    document = " ".join(sentences)
    opening = " ".join(document.split()[:_RESTATED_TOKENS // 2])
    text = _INSTRUCTION + document + _ANSWER
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        return list(ids) + tokenizer(opening, add_special_tokens=False).input_ids
    return tokenizer(text + opening).input_ids


def copy_rate(prompts: list[list[int]], outputs: list[list[int]]) -> float:
    """The share of output tokens that continue a ``COPY_NGRAM``-gram of their prompt."""
    copied = total = 0
    n = COPY_NGRAM
    for prompt, output in zip(prompts, outputs, strict=True):
        grams = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
        tokens = list(prompt[-(n - 1):]) + list(output)
        copied += sum(tuple(tokens[i : i + n]) in grams for i in range(len(output)))
        total += len(output)
    return copied / total if total else 0.0
