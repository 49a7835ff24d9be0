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

    from benchmarks import structured_check

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


def test_copy_rate_counts_output_tokens_that_continue_a_prompt_ngram():
    from inference.bench.copy_workload import copy_rate

    # With the prompt's last three tokens, outputs 4, 5, 6 continue 4-grams of the prompt.
    assert copy_rate([[1, 2, 3, 4, 5, 6, 1, 2, 3]], [[4, 5, 6, 7]]) == 0.75
    assert copy_rate([[1, 2, 3, 4]], [[9, 9]]) == 0.0


def test_copy_prompts_hold_a_document_of_the_length_asked_for(tmp_path):
    from transformers import AutoTokenizer

    from inference.bench.copy_workload import PROMPT_OVERHEAD_TOKENS, copy_prompts
    from inference.model_shapes import write_synthetic_tokenizer

    ids = copy_prompts(None, 2, 100, 5000, seed=1)
    assert len(ids) == 2 and ids[0] != ids[1]
    assert ids[0][100:] == ids[0][:16]  # the document's start again: copying continues it
    # A tokenizer that knows none of the words (the named shapes'): token ids instead.
    write_synthetic_tokenizer(tmp_path, 1000, eos_token_id=7)
    assert len(copy_prompts(AutoTokenizer.from_pretrained(tmp_path), 1, 50, 1000)[0]) == 66
    # Text: the embedded model's tokenizer builds documents of at most the length asked.
    from inference.model_files import ensure_default_model, load_tokenizer

    tokenizer = load_tokenizer(ensure_default_model())
    prompt = copy_prompts(tokenizer, 1, 200, len(tokenizer))[0]
    assert 150 < len(prompt) <= 200 + PROMPT_OVERHEAD_TOKENS


def test_latency_bench_reports_copy_rate_and_acceptance(tmp_path, capsys):
    """A tiny model on CPU: the copy workload and n-gram speculation reach the JSON and the
    printout (acceptance length, acceptance rate, copy rate)."""
    from tiny_models import build_successor_model

    from inference.cli import build_parser

    build_successor_model(tmp_path / "m", {10: 11, 11: 12, 12: 10})
    out = tmp_path / "r.json"
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    args = build_parser().parse_args([
        "bench", "latency", "--model", str(tmp_path / "m"), "--device", "cpu", "--workload",
        "copy", "--document-len", "40", "--output-len", "12", "--num-iters", "1",
        "--speculative-config", spec, "--num-kv-blocks", "64", "--output-json", str(out),
    ])
    assert args.func(args) == 0
    (result,) = json.loads(out.read_text())
    assert result["prompt_workload"] == "copy" and result["document_len"] == 40
    assert 0.0 <= result["copy_rate"] <= 1.0
    assert result["speculative_method"] == "ngram"
    assert result["mean_acceptance_length"] >= 1.0
    assert 0.0 <= result["acceptance_rate"] <= 1.0
    assert "acceptance rate" in capsys.readouterr().out


def test_throughput_bench_reports_a_draft_models_acceptance(tmp_path, capsys):
    """The target as its own draft: nearly every draft accepted, and said so."""
    from tiny_models import build_successor_model

    from inference.cli import build_parser

    model = str(tmp_path / "m")
    build_successor_model(tmp_path / "m", {10: 11, 11: 12, 12: 10})
    out = tmp_path / "r.json"
    spec = json.dumps({"method": "draft_model", "model": model, "num_speculative_tokens": 3})
    args = build_parser().parse_args([
        "bench", "throughput", "--model", model, "--device", "cpu", "--num-prompts", "3",
        "--input-len", "8", "--output-len", "12", "--speculative-config", spec,
        "--num-kv-blocks", "64", "--output-json", str(out),
    ])
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert result["speculative_method"] == "draft_model"
    assert result["acceptance_rate"] > 0.9 and result["mean_acceptance_length"] > 3.0
    assert "copy_rate" not in result  # random prompts
    assert "speculative decoding (draft_model, k=3)" in capsys.readouterr().out
