"""load_tokenizer takes the class a folder's tokenizer_config.json names without importing
AutoTokenizer's module (which drags in transformers' model registry, generation and FSDP
code: seconds of every engine start), and loads exactly what AutoTokenizer would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import build_tokenizer

from inference.model_files import load_tokenizer
from inference.model_shapes import write_synthetic_tokenizer

TEXTS = ["Hello, world!", "naïve café — 東京 🚀 \u200b tabs\tand\nnewlines", "", " x" * 50]


@pytest.fixture(params=["byte-level-bpe", "word-level"])
def tokenizer_folder(request, tmp_path: Path) -> Path:
    folder = tmp_path / request.param
    if request.param == "byte-level-bpe":
        build_tokenizer(folder)
    else:
        write_synthetic_tokenizer(folder, vocab_size=500, eos_token_id=2)
    return folder


def _same(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    assert ours.all_special_ids == theirs.all_special_ids
    assert ours.eos_token_id == theirs.eos_token_id and ours.bos_token_id == theirs.bos_token_id
    assert ours.chat_template == theirs.chat_template
    for text in TEXTS:
        ids = theirs(text).input_ids
        assert ours(text).input_ids == ids
        assert ours.decode(ids) == theirs.decode(ids)


def test_named_class_loads_what_autotokenizer_loads(tokenizer_folder: Path) -> None:
    from transformers import AutoTokenizer

    _same(load_tokenizer(tokenizer_folder), AutoTokenizer.from_pretrained(str(tokenizer_folder)))


def test_unknown_or_missing_class_falls_back_to_autotokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = tmp_path / "tok"
    build_tokenizer(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for name in ("NoSuchTokenizer", None, "not an identifier"):
        if name is None:
            config.pop("tokenizer_class", None)
        else:
            config["tokenizer_class"] = name
        config_path.write_text(json.dumps(config))
        _same(load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder)))


def test_loading_does_not_import_autotokenizer_module(tmp_path: Path) -> None:
    folder = tmp_path / "tok"
    build_tokenizer(folder)
    root = Path(__file__).resolve().parent.parent
    code = (
        "import sys; from inference.model_files import load_tokenizer; "
        f"tok = load_tokenizer({str(folder)!r}); assert tok is not None; "
        "heavy = [m for m in ('transformers.models.auto.tokenization_auto', "
        "'transformers.models.auto.modeling_auto', 'transformers.generation.utils') "
        "if m in sys.modules]; print(heavy); sys.exit(1 if heavy else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=root, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
