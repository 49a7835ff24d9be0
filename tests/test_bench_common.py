"""Bench plumbing that runs on CPU: named shapes and the synthetic tokenizer."""

import json
from pathlib import Path

import pytest

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


def test_copy_chain_links_each_token_to_the_next_except_where_broken():
    import numpy as np

    from inference.bench.copy_workload import CopyChain

    whole = CopyChain(5000, 100)
    chain = whole.chain
    assert len(set(chain.tolist())) == len(chain) and whole.broken.size == 0
    assert all(whole.successor(int(chain[j])) == int(chain[j + 1]) for j in (0, 7, 500))
    broken = CopyChain(5000, 100, miss_rate=0.3, seed=2)
    assert 0.2 < broken.broken.size / len(broken.chain) < 0.4
    j = int(broken.broken[3])
    own = broken.successor(int(broken.chain[j]))
    assert own not in set(broken.chain.tolist())  # a token of its own, off the chain
    assert broken.successor(own) == int(broken.chain[j + 2])  # then back onto the chain
    prompt = broken.prompt(np.random.default_rng(0), 100)
    start = int(np.flatnonzero(broken.chain == prompt[0])[0])
    assert prompt[:100] == broken.chain[start : start + 100].tolist()
    assert prompt[100:] == prompt[:16]


@pytest.mark.parametrize("miss_rate", [0.0, 0.25])
def test_a_copier_model_continues_the_chain_and_its_copy_rate_follows(tmp_path, miss_rate):
    """make_copier on random weights: greedy output walks the chain's successor table
    exactly, so the copy rate is 1 with no broken links and falls with them."""
    from tiny_models import build_tiny_model

    from inference import LLM, SamplingParams
    from inference.bench.copy_workload import CopyChain, copy_rate, make_copier

    build_tiny_model(tmp_path / "m", "llama", tie_word_embeddings=False)
    llm = LLM(str(tmp_path / "m"), device="cpu", load_format="dummy", num_kv_blocks=64)
    vocab = llm.engine.model_config.vocab_size
    chain = CopyChain(vocab, 48, miss_rate=miss_rate, seed=1)
    make_copier(llm.engine.runner.model, chain)
    prompts = copy_prompts_of(chain, 3, 48)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20,
                                                ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        expected, token = [], prompt[-1]
        for _ in range(20):
            token = chain.successor(token)
            expected.append(token)
        assert list(out.outputs[0].token_ids) == expected
    rate = copy_rate(prompts, [o.outputs[0].token_ids for o in outs])
    assert rate == 1.0 if miss_rate == 0.0 else rate < 1.0


def copy_prompts_of(chain, num, document_len):
    from inference.bench.copy_workload import copy_prompts

    return copy_prompts(None, num, document_len, 0, seed=5, chain=chain)


def test_copy_model_needs_the_copy_workload_on_a_named_shape():
    from inference.bench.common import copy_model_folder
    from inference.cli import build_parser

    args = build_parser().parse_args(["bench", "latency", "--workload", "copy",
                                      "--copy-model", "--document-len", "64"])
    with pytest.raises(SystemExit, match="named shape"):
        copy_model_folder(args, "/some/model", {})
    folder, extra = resolve_shape_model("qwen2.5-1.5b")
    copy_model_folder(args, folder, extra)
    assert json.loads(Path(folder, "config.json").read_text())["tie_word_embeddings"] is False
    assert args.copy_chain.chain.size >= 20_000


def test_latency_bench_with_a_copier_reports_full_copy_and_acceptance(tmp_path, monkeypatch):
    """``--copy-model`` end to end on CPU, a tiny model standing in for a named shape: the
    copier copies every token and n-gram drafts from the document are all accepted."""
    from tiny_models import build_tiny_model

    from inference.bench import latency
    from inference.cli import build_parser

    build_tiny_model(tmp_path / "m", "llama")
    monkeypatch.setattr(latency, "resolve_shape_model",
                        lambda model: (str(tmp_path / "m"), {"load_format": "dummy"}))
    out = tmp_path / "r.json"
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    args = build_parser().parse_args([
        "bench", "latency", "--model", "qwen2.5-1.5b", "--device", "cpu", "--workload", "copy",
        "--copy-model", "--document-len", "48", "--output-len", "12", "--num-iters", "1",
        "--speculative-config", spec, "--num-kv-blocks", "64", "--output-json", str(out),
    ])
    assert args.func(args) == 0
    (result,) = json.loads(out.read_text())
    assert result["copy_model"] is True and result["copy_rate"] == 1.0
    assert result["acceptance_rate"] == 1.0 and result["mean_acceptance_length"] > 2.0


def test_a_draft_copier_is_accepted_about_as_often_as_it_copies(tmp_path, monkeypatch):
    """``--copy-model`` with a named-shape draft model: the draft is made a copier of the
    same chain missing ``--draft-copy-miss-rate`` of its links, so its acceptance is
    controlled; the target's output is still the chain, whatever the draft proposed."""
    import shutil

    from tiny_models import build_tiny_model

    from inference import model_shapes
    from inference.bench import latency
    from inference.cli import build_parser

    build_tiny_model(tmp_path / "m", "llama")
    build_tiny_model(tmp_path / "d", "llama", num_hidden_layers=1, seed=3)
    monkeypatch.setattr(latency, "resolve_shape_model",
                        lambda model: (str(tmp_path / "m"), {"load_format": "dummy"}))

    def draft_shape(name):  # the draft's named shape stands for the tiny draft folder
        copy = tmp_path / f"draft-{len(list(tmp_path.glob('draft-*')))}"
        shutil.copytree(tmp_path / "d", copy)
        return str(copy), {"load_format": "dummy"}

    monkeypatch.setattr(model_shapes, "shape_config",
                        lambda name: {} if name == "tiny-draft" else None)
    monkeypatch.setattr(model_shapes, "resolve_shape_model", draft_shape)
    out = tmp_path / "r.json"
    spec = '{"method": "draft_model", "model": "tiny-draft", "num_speculative_tokens": 3}'
    args = build_parser().parse_args([
        "bench", "latency", "--model", "qwen2.5-1.5b", "--device", "cpu", "--workload", "copy",
        "--copy-model", "--document-len", "48", "--output-len", "24", "--num-iters", "2",
        "--draft-copy-miss-rate", "0.3", "--speculative-config", spec, "--num-kv-blocks", "64",
        "--output-json", str(out),
    ])
    assert args.func(args) == 0
    (result,) = json.loads(out.read_text())
    assert result["copy_rate"] == 1.0 and result["draft_copy_miss_rate"] == 0.3
    assert result["speculative_method"] == "draft_model"
    assert 0.3 < result["acceptance_rate"] < 0.95
