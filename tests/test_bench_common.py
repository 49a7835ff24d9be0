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


def test_structured_check_reports_where_a_step_goes(tmp_path):
    """The grammar-mask benchmark runs on CPU with a tiny model and reports every phase."""
    import argparse

    from tiny_models import build_tokenizer

    from inference.bench import structured_check

    build_tokenizer(tmp_path / "tok")
    out = tmp_path / "out.json"
    args = structured_check.add_args(argparse.ArgumentParser()).parse_args([
        "--model", "tiny", "--tokenizer", str(tmp_path / "tok"), "--device", "cpu",
        "--batch-size", "2", "--input-len", "8", "--output-len", "10", "--out", str(out),
    ])  # fmt: skip
    assert structured_check.run(args) == 0
    (row,) = json.loads(out.read_text())
    assert row["batch_size"] == 2 and row["step_grammar"] == "json"
    assert row["fill_ms_mean"] > 0 and row["advance_ms_mean"] > 0
    phases = row["phases_ms_constrained"]
    assert set(phases) == set(structured_check.PHASES)
    assert phases["fill"] > 0 and phases["advance"] > 0 and phases["apply"] > 0
    assert row["phases_ms_plain"]["fill"] == 0
