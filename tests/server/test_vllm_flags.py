"""vLLM command lines run under `pagoda serve` unchanged: every flag a vLLM deployment
passes parses, with vLLM's meaning, or is refused with a reason (never "unrecognized")."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest
import yaml

from inference.config import EngineConfig
from inference.generation_defaults import generation_defaults
from inference.server.cli_serve import (
    add_serve_args,
    check_serve_args,
    engine_config,
    served_names,
    serving_options,
)
from inference.server.vllm_flags import IGNORED_DEST, normalize_flag_spelling

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_command_lines.yaml"
COMMAND_LINES = yaml.safe_load(FIXTURE.read_text())


class _ParseError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would exit; the test wants the message
        raise _ParseError(message)


def parse(argv: list[str]) -> argparse.Namespace:
    return add_serve_args(_Parser(prog="pagoda serve")).parse_args(normalize_flag_spelling(argv))


def settings(argv: list[str]) -> tuple[argparse.Namespace, EngineConfig]:
    args = parse(argv)
    return args, engine_config(args, served_names(args))


@pytest.mark.parametrize("line", COMMAND_LINES, ids=lambda line: line["source"].split("/")[-1])
def test_real_vllm_command_lines_parse(line) -> None:
    args, config = settings(line["args"])  # raises on any unknown flag or bad value
    refused = check_serve_args(args)
    expected = line.get("refused", [])
    assert len(refused) == len(expected), refused
    for flag, message in zip(expected, refused, strict=True):
        assert message.startswith(flag) and ": " in message  # the flag, then why
    argv = line["args"]
    model = argv[argv.index("--model") + 1] if "--model" in argv else argv[0]
    assert config.model == model


# Each flag of the issue, and what it must set (dest -> value) or say.
LISTED_FLAGS = [
    (["--chat-template", "{{ messages[0]['content'] }}"], "chat_template", "{{ messages[0]['content'] }}"),
    (["--chat-template-content-format", "openai"], "chat_template_content_format", "openai"),
    (["--response-role", "bot"], "response_role", "bot"),
    (["--return-tokens-as-token-ids"], "return_tokens_as_token_ids", True),
    (["--enable-log-requests"], "log_requests", True),
    (["--disable-log-requests"], "log_requests", False),
    (["--max-log-len", "40"], "max_log_len", 40),
    (["--disable-log-stats"], "disable_log_stats", True),
    (["--reasoning-parser", "deepseek_r1"], "reasoning_parser", "deepseek_r1"),
    (["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"], "ssl_certfile", "c.pem"),
    (["--root-path", "/llm"], "root_path", "/llm"),
]


@pytest.mark.parametrize(("argv", "dest", "value"), LISTED_FLAGS, ids=lambda x: str(x))
def test_server_flags_keep_vllms_meaning(argv, dest, value) -> None:
    args = parse(argv)
    assert getattr(args, dest) == value
    assert check_serve_args(args) == []


ENGINE_FLAGS = [
    (["--generation-config", "vllm"], "generation_config", "vllm"),
    (["--override-generation-config", '{"temperature": 0.5}'], "override_generation_config",
     '{"temperature": 0.5}'),
    (["--trust-remote-code"], "trust_remote_code", True),
    (["--revision", "main"], "revision", "main"),
    (["--tokenizer-revision", "v2"], "tokenizer_revision", "v2"),
    (["--download-dir", "/cache"], "download_dir", "/cache"),
    (["--max-logprobs", "5"], "max_logprobs", 5),
    (["--enable-chunked-prefill"], "enable_chunked_prefill", True),
    (["--swap-space", "16"], "swap_space", 16.0),
]


@pytest.mark.parametrize(("argv", "field", "value"), ENGINE_FLAGS, ids=lambda x: str(x))
def test_engine_flags_reach_the_engine_config(argv, field, value) -> None:
    _, config = settings(argv)
    assert getattr(config, field) == value


def test_model_flag_is_the_positional_alternative() -> None:
    assert settings(["--model", "/models/a"])[1].model == "/models/a"
    assert settings(["/models/a"])[1].model == "/models/a"
    assert settings([])[1].model == "default"
    with pytest.raises(ValueError, match="two models"):
        settings(["/models/a", "--model", "/models/b"])


def test_inapplicable_settings_are_accepted_and_say_why() -> None:
    _, config = settings(["--trust-remote-code", "--swap-space", "4", "--download-dir", "/d",
                          "--revision", "r"])
    notes = " ".join(config.ignored_settings())
    assert "never runs code shipped with a checkpoint" in notes
    assert "recomputed" in notes
    assert "never downloads" in notes and "--revision" in notes
    assert settings([])[1].ignored_settings() == []


def test_no_chunked_prefill_is_refused_with_the_way_out() -> None:
    with pytest.raises(ValueError, match="max-num-batched-tokens"):
        settings(["--no-enable-chunked-prefill"])


def test_foreign_flags_are_ignored_when_harmless_and_refused_otherwise() -> None:
    args = parse(["--pipeline-parallel-size", "1", "--language-model-only"])
    assert check_serve_args(args) == []
    assert len(getattr(args, IGNORED_DEST)) == 2
    refused = check_serve_args(parse(["-pp", "2", "--enable-sleep-mode"]))
    assert [m.split(":")[0] for m in refused] == ["-pp 2", "--enable-sleep-mode"]
    assert "no pipeline parallelism" in refused[0]


def test_underscore_spelling_as_vllm() -> None:
    assert normalize_flag_spelling(["--max_num_seqs=8", "--max_model_len", "x_y"]) == [
        "--max-num-seqs=8", "--max-model-len", "x_y"]


def test_chat_template_file_or_inline(tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ 'hi' }}")
    assert serving_options(parse(["--chat-template", str(path)])).chat_template == "{{ 'hi' }}"
    with pytest.raises(ValueError, match="neither a file nor a template"):
        serving_options(parse(["--chat-template", str(tmp_path / "missing.jinja")]))


def test_ssl_flags_go_together() -> None:
    assert check_serve_args(parse(["--ssl-keyfile", "k.pem"])) == [
        "--ssl-keyfile and --ssl-certfile go together"]


def _folder_with_generation_config(tmp_path: Path, values: dict) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(values))
    return tmp_path


def test_generation_config_defaults_as_vllm(tmp_path, caplog) -> None:
    folder = _folder_with_generation_config(tmp_path, {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05,
        "max_new_tokens": 512, "do_sample": True, "bos_token_id": 1,
    })
    auto = EngineConfig(model=str(folder))
    with caplog.at_level(logging.WARNING):
        assert generation_defaults(auto, folder) == {
            "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05,
            "max_tokens": 512,
        }
    assert "generation-config vllm" in caplog.text
    assert generation_defaults(EngineConfig(model="m", generation_config="vllm"), folder) == {}
    other = tmp_path / "other"
    other.mkdir()
    _folder_with_generation_config(other, {"min_p": 0.1})
    assert generation_defaults(EngineConfig(model="m", generation_config=str(other)),
                               folder) == {"min_p": 0.1}
    override = EngineConfig(model="m", generation_config="vllm",
                            override_generation_config='{"temperature": 0.2}')
    assert generation_defaults(override, folder) == {"temperature": 0.2}


def test_generation_config_keeps_hugging_faces_defaults_out(tmp_path) -> None:
    # vLLM reads the file's difference from transformers' defaults: top_k 50 is not applied.
    folder = _folder_with_generation_config(tmp_path, {"top_k": 50, "temperature": 1.0})
    assert generation_defaults(EngineConfig(model="m"), folder) == {}


def test_bad_generation_config_fails_at_start(tmp_path) -> None:
    with pytest.raises(ValueError, match="JSON object"):
        EngineConfig(model="m", override_generation_config="[1]")
    with pytest.raises(ValueError, match="not a folder"):
        generation_defaults(EngineConfig(model="m", generation_config="/nowhere"), tmp_path)
    folder = _folder_with_generation_config(tmp_path, {"temperature": -1})
    with pytest.raises(ValueError, match="temperature"):
        generation_defaults(EngineConfig(model="m"), folder)
