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
it beside the acceptance rate. Random weights copy nothing, whatever the prompt, so a named
shape can be made a **copier** (``--copy-model``, ``CopyChain``): its random weights are set
so that its greedy next token is the next token of one long random chain of token ids, each
document is a slice of that chain, and with ``--copy-miss-rate`` a share of the chain's
links is broken (the model emits a token of its own there, then rejoins the chain one token
later). Every kernel still runs at the shape's full size, so the speed is the real model's
at the copy rate reported.
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
    tokenizer, num: int, document_len: int, vocab_size: int, seed: int = 0,
    chain: CopyChain | None = None,
) -> list[list[int]]:
    """``num`` prompts, each with its own document of about ``document_len`` tokens (with
    ``chain``: slices of it, what a copier model continues)."""
    rng = np.random.default_rng(seed)
    if chain is not None:
        return [chain.prompt(rng, document_len) for _ in range(num)]
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


class CopyChain:
    """One random chain of distinct token ids and the successor table a copier model is
    given: ``successors[chain[j]] = chain[j + 1]``, except at the broken links (a share
    ``miss_rate`` of them), where ``chain[j]`` is followed by an off-chain token of its own
    and that token by ``chain[j + 2]``. Documents are slices of the chain."""

    def __init__(self, vocab_size: int, document_len: int, miss_rate: float = 0.0,
                 seed: int = 0) -> None:  # fmt: skip
        if not 0.0 <= miss_rate < 1.0:
            raise ValueError(f"--copy-miss-rate must be in [0, 1), got {miss_rate}")
        rng = np.random.default_rng(seed)
        low = 1000 if vocab_size > 8000 else 3  # clear of special and low ids
        ids = rng.permutation(np.arange(low, vocab_size - low))
        length = min(max(8 * document_len, 20_000), len(ids) // 2)
        if length < document_len + _RESTATED_TOKENS + 2:
            raise ValueError(f"a vocabulary of {vocab_size} is too small for documents of "
                             f"{document_len} tokens")
        self.chain = ids[:length]
        broken = np.flatnonzero(rng.random(length - 2) < miss_rate)
        off_chain = ids[length : length + len(broken)]
        self.broken = broken
        sources = [self.chain[:-1]]
        targets = [self.chain[1:].copy()]
        targets[0][broken] = off_chain  # chain[j] -> its own token at a broken link
        sources.append(off_chain)
        targets.append(self.chain[broken + 2])  # ... then back onto the chain
        self.sources = np.concatenate(sources)
        self.targets = np.concatenate(targets)

    def prompt(self, rng: np.random.Generator, document_len: int) -> list[int]:
        start = int(rng.integers(0, len(self.chain) - document_len - 1))
        document = self.chain[start : start + document_len].tolist()
        return document + document[:_RESTATED_TOKENS]

    def successor(self, token: int) -> int | None:
        hits = np.flatnonzero(self.sources == token)
        return int(self.targets[hits[0]]) if hits.size else None


def make_copier(model, chain: CopyChain) -> None:
    """Set a loaded model's weights (in place: captured CUDA graphs keep reading them) so
    that its greedy next token is ``chain``'s successor of the current token: every layer's
    output projections zero (the final hidden state is the token's own embedding), the
    final norm's weight one, and the LM head row of each successor the sum of its sources'
    embeddings. Random embeddings of the shape's width are nearly orthogonal, so that row
    wins by a wide margin. The model needs its own LM head (``tie_word_embeddings`` off)
    and full-precision projections."""
    import torch

    if getattr(model, "lm_head", None) is None:
        raise ValueError("a copier needs an untied LM head (tie_word_embeddings false)")
    layers = list(model.layers)
    for layer in layers:
        for name in ("o_proj", "down_proj"):
            weight = getattr(layer, name)
            if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or (
                    weight.element_size() < 2):  # fmt: skip
                raise ValueError("a copier needs full-precision weights (no FP8 or int4)")
    with torch.no_grad():
        for layer in layers:
            layer.o_proj.zero_()
            layer.down_proj.zero_()
        model.norm.fill_(1.0)
        embed = model.embed_tokens
        generator = torch.Generator(device=embed.device).manual_seed(0)
        rows = torch.randn(embed.shape, generator=generator, device=embed.device,
                           dtype=torch.float32)  # fmt: skip
        rows /= rows.norm(dim=1, keepdim=True)
        embed.copy_(rows)
        head = torch.zeros_like(rows)
        sources = torch.from_numpy(chain.sources).to(embed.device)
        targets = torch.from_numpy(chain.targets).to(embed.device)
        head.index_add_(0, targets, rows[sources])
        model.lm_head.copy_(head)
