r"""``\d`` in a structured-output regex or JSON Schema pattern means the ASCII digits
[0-9], as JSON Schema and most users mean it; the regex engine's own ``\d`` would also
admit every Unicode digit, such as the Arabic-Indic three "٣"."""

from __future__ import annotations

import llguidance
import llguidance.hf
import pytest

from inference.sampling_params import StructuredOutputsParams
from inference.structured_output import ascii_digits, grammar_source


@pytest.fixture(scope="module")
def tokenizer(smol_tokenizer_folder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_tokenizer_folder)
    return tok, llguidance.hf.from_tokenizer(tok)


@pytest.fixture(scope="module")
def smol_tokenizer_folder() -> str:
    from inference.model_files import ensure_default_model

    return str(ensure_default_model())


def _accepts(tokenizer, spec: StructuredOutputsParams, text: str) -> bool:
    tok, lltok = tokenizer
    matcher = llguidance.LLMatcher(lltok, grammar_source(spec), log_level=0)
    return matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and \
        not matcher.is_error()


@pytest.mark.parametrize("spec", [
    StructuredOutputsParams(regex=r"\d+"),
    StructuredOutputsParams(regex=r"[\d]+"),
    StructuredOutputsParams(json={"type": "object", "properties": {
        "n": {"type": "string", "pattern": r"^\d+$"}}, "required": ["n"]}),
])  # fmt: skip
def test_backslash_d_admits_ascii_digits_only(tokenizer, spec) -> None:
    sample = '{"n": "%s"}' if spec.json else "%s"
    assert _accepts(tokenizer, spec, sample % "42")
    assert not _accepts(tokenizer, spec, sample % "٣")


def test_translation_leaves_escapes_and_classes_alone() -> None:
    assert ascii_digits(r"\d{3}-\D") == "[0-9]{3}-[^0-9]"
    assert ascii_digits(r"[a\d]") == "[a0-9]"
    assert ascii_digits(r"\\d") == r"\\d"  # an escaped backslash, then the letter d
    assert ascii_digits(r"\w\.") == r"\w\."
