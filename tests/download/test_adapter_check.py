"""``pagoda download --lora-max-rank``: a downloaded folder that is no adapter the engine
serves fails the download (exit 6, ``InvalidAdapter``), before any engine starts with it."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from inference.cli import main


def write_adapter(folder: Path, rank: int, **config: object) -> Path:
    """A PEFT folder with one layer's q_proj update (the header is all the check reads)."""
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj"],
         **config}))  # fmt: skip
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    shapes = {f"{prefix}.lora_A.weight": [rank, 8], f"{prefix}.lora_B.weight": [8, rank]}
    header, offset = {}, 0
    for key, shape in shapes.items():
        size = 4 * shape[0] * shape[1]
        header[key] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    (folder / "adapter_model.safetensors").write_bytes(
        struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return folder


def download(tmp_path: Path, origin: Path, *flags: str) -> tuple[int, dict]:
    result = tmp_path / "result.json"
    code = main(["download", str(origin), str(tmp_path / "dest"), "--result-file", str(result),
                 *flags])  # fmt: skip
    return code, json.loads(result.read_text())


def test_an_adapter_within_the_rank_is_downloaded(tmp_path: Path) -> None:
    code, result = download(tmp_path, write_adapter(tmp_path / "a", 8), "--lora-max-rank", "8")
    assert code == 0 and result["files"] == 2  # adapter_config.json, adapter_model.safetensors


@pytest.mark.parametrize(
    ("rank", "config", "expected"),
    [
        (32, {}, "rank 32 exceeds --max-lora-rank 16"),
        (8, {"use_dora": True}, "DoRA adapters"),
        (8, {"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ],
)
def test_an_adapter_the_engine_refuses_fails_the_download(
    tmp_path: Path, rank: int, config: dict, expected: str
) -> None:
    origin = write_adapter(tmp_path / "a", rank, **config)
    code, result = download(tmp_path, origin, "--lora-max-rank", "16")
    assert code == 6  # permanent: the loader Job's pod failure policy stops at once
    assert result["error"] == "InvalidAdapter" and expected in result["message"]


def test_a_folder_that_is_no_adapter_fails_the_download(tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"x")
    code, result = download(tmp_path, tmp_path / "weights", "--lora-max-rank", "16")
    assert code == 6 and "adapter_config.json" in result["message"]


def test_without_the_flag_nothing_is_checked(tmp_path: Path) -> None:
    code, _ = download(tmp_path, write_adapter(tmp_path / "a", 64))
    assert code == 0
