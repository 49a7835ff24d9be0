"""Bench plumbing that runs on CPU: named shapes and the synthetic tokenizer."""

import json

from inference.model_shapes import SHAPES, resolve_shape_model, write_synthetic_tokenizer
from inference.models.config import ModelConfig


def test_named_shapes_parse_as_supported_models():
    for name, cfg in SHAPES.items():
        parsed = ModelConfig.from_dict(cfg)
        assert parsed.vocab_size == cfg["vocab_size"], name


def test_shape_folder_holds_config_only_for_offline_benches():
    folder, extra = resolve_shape_model("qwen2.5-7b")
    assert extra == {"load_format": "dummy"}
    assert json.loads(open(f"{folder}/config.json").read())["hidden_size"] == 3584


def test_synthetic_tokenizer_covers_the_vocabulary(tmp_path):
    from transformers import AutoTokenizer

    write_synthetic_tokenizer(tmp_path, 1000, eos_token_id=7)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 1000 and tok.eos_token_id == 7
    assert tok("w5 w999").input_ids == [5, 999]
    assert tok.decode([5, 999, 3]) == "w5 w999 w3"
