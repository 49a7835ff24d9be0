"""The DecodeStream detokenizer gives exactly the text of the Python one (the reference:
vLLM's algorithm over ``tokenizer.decode``), token by token, on real tokenizers and on the
sequences that split characters across tokens."""

from __future__ import annotations

import random

import pytest

from inference.detokenizer import IncrementalDetokenizer

MULTILINGUAL = (
    "Hello, world! Ünïcödé ✓ 日本語のテキスト 🎉🎉👩‍👩‍👧 emoji, code: def f(x): return x**2\n"
    "\tTabs   and  spaces; Ελληνικά, русский, العربية, हिन्दी. € £ ¥ — “quotes” …"
)


def run_both(tokenizer, prompt: list[int], outputs: list[int], skip: bool) -> tuple[str, str]:
    fast = IncrementalDetokenizer(tokenizer, prompt, skip)
    slow = IncrementalDetokenizer(tokenizer, prompt, skip, use_decode_stream=False)
    for position, token_id in enumerate(outputs):
        fast_delta, slow_delta = fast.add(token_id), slow.add(token_id)
        assert fast_delta == slow_delta, (position, token_id, fast.text, slow.text)
    assert fast.text == slow.text
    return fast.text, slow.text


def sequences(tokenizer, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, outputs) pairs: real text, text cut mid-character at both ends, random ids
    (stray UTF-8 continuation bytes, special tokens), and special tokens between words."""
    rng = random.Random(seed)
    text_ids = tokenizer(MULTILINGUAL, add_special_tokens=False).input_ids
    vocab = len(tokenizer)
    special = list(tokenizer.all_special_ids)
    cases = [([], text_ids), (text_ids[:5], text_ids[5:])]
    for _ in range(12):
        cut = rng.randrange(1, len(text_ids) - 1)  # often inside a multi-byte character
        cases.append((text_ids[:cut], text_ids[cut:]))
    for _ in range(12):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        cases.append((prompt, [rng.randrange(vocab) for _ in range(60)]))
    mixed = []
    for token_id in text_ids[:40]:
        mixed.append(token_id)
        if special and rng.random() < 0.2:
            mixed.append(rng.choice(special))
    cases.append((special[:2], mixed))
    return cases


@pytest.fixture(scope="module")
def smol_tokenizer(smol_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_model)


@pytest.fixture(scope="module")
def metaspace_tokenizer(tmp_path_factory):
    """The bench's synthetic word-level tokenizer (a Metaspace decoder, like sentencepiece)."""
    from transformers import AutoTokenizer

    from inference.model_shapes import write_synthetic_tokenizer

    folder = tmp_path_factory.mktemp("synthetic_tokenizer")
    write_synthetic_tokenizer(folder, 1000, 2)
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def tiny_bpe_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def test_smollm2_takes_the_decode_stream_path(smol_tokenizer):
    detok = IncrementalDetokenizer(smol_tokenizer, [1, 2, 3], True)
    assert detok._stream is not None
    assert (
        IncrementalDetokenizer(smol_tokenizer, [1], True, use_decode_stream=False)._stream is None
    )


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_parity_on_smollm2(smol_tokenizer, skip_special_tokens):
    for prompt, outputs in sequences(smol_tokenizer, seed=1):
        run_both(smol_tokenizer, prompt, outputs, skip_special_tokens)


def test_whole_text_round_trips(smol_tokenizer):
    ids = smol_tokenizer(MULTILINGUAL, add_special_tokens=False).input_ids
    text, _ = run_both(smol_tokenizer, [], ids, True)
    assert text == MULTILINGUAL


def test_characters_split_across_tokens_appear_whole(smol_tokenizer):
    ids = smol_tokenizer(" 🎉", add_special_tokens=False).input_ids
    assert len(ids) > 1, "the emoji must span several byte tokens for this test"
    detok = IncrementalDetokenizer(smol_tokenizer, [], True)
    deltas = [detok.add(token_id) for token_id in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == " 🎉"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_parity_on_metaspace_and_byte_level_bpe(
    metaspace_tokenizer, tiny_bpe_tokenizer, skip_special_tokens
):
    for tokenizer in (metaspace_tokenizer, tiny_bpe_tokenizer):
        for prompt, outputs in sequences(tokenizer, seed=2):
            run_both(tokenizer, prompt, outputs, skip_special_tokens)


def test_truncated_text_keeps_growing(smol_tokenizer):
    # The engine cuts ``text`` at a stop string; later additions append to the cut text.
    ids = smol_tokenizer(" one two three", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(smol_tokenizer, [], True)
    detok.add(ids[0])
    detok.text = detok.text[:2]
    for token_id in ids[1:]:
        detok.add(token_id)
    assert detok.text == " o two three"
