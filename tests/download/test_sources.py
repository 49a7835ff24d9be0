"""Source URIs, local folders and progress reporting of `pagoda download`."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from inference.download import download
from inference.download.common import (
    IntegrityError,
    InvalidSourceError,
    LogTqdm,
    Source,
    parse_source,
    read_manifest,
    safe_relative,
)


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("hf://Qwen/Qwen2.5-7B-Instruct", Source("hf://Qwen/Qwen2.5-7B-Instruct", "hf", "Qwen/Qwen2.5-7B-Instruct")),
        ("hf://org/name@v1.0", Source("hf://org/name@v1.0", "hf", "org/name", revision="v1.0")),
        ("s3://bucket/models/qwen/", Source("s3://bucket/models/qwen/", "s3", "bucket", "models/qwen")),
        ("s3://bucket", Source("s3://bucket", "s3", "bucket", "")),
        ("pvc://weights/qwen/7b", Source("pvc://weights/qwen/7b", "pvc", "weights", "qwen/7b")),
        ("file:///data/m", Source("file:///data/m", "file", "/data/m")),
        ("/data/m", Source("/data/m", "file", "/data/m")),
    ],
)  # fmt: skip
def test_parse_source(uri: str, expected: Source) -> None:
    assert parse_source(uri) == expected


@pytest.mark.parametrize(
    "uri", ["hf://just-a-name", "hf://org/name@", "s3://", "pvc://", "gs://bucket/x", ""]
)
def test_bad_uris_are_refused_with_the_expected_form(uri: str) -> None:
    with pytest.raises(InvalidSourceError):
        parse_source(uri)


@pytest.mark.parametrize("key", ["m/../../etc/passwd", "m/.pagoda/manifest.json", "m/"])
def test_keys_cannot_escape_the_target(key: str) -> None:
    with pytest.raises(IntegrityError):
        safe_relative("m", key)


def test_local_folder_is_copied_and_recorded(tmp_path: Path) -> None:
    origin = tmp_path / "origin"
    (origin / "sub").mkdir(parents=True)
    (origin / "config.json").write_text("{}")
    (origin / "sub" / "w.bin").write_bytes(b"x" * 100)
    manifest = download(str(origin), tmp_path / "dest")
    assert (tmp_path / "dest" / "sub" / "w.bin").read_bytes() == b"x" * 100
    assert manifest.num_bytes == 102
    assert read_manifest(tmp_path / "dest") == manifest
    # The target itself: nothing to copy, still recorded.
    assert download(str(origin), origin).num_bytes == 102


def test_pvc_source_is_mounted_not_downloaded(tmp_path: Path) -> None:
    with pytest.raises(InvalidSourceError, match="mounted"):
        download("pvc://weights/qwen", tmp_path)


def test_progress_becomes_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="inference.download"):
        with LogTqdm(total=1000, unit="B", desc="weights") as bar:
            bar.update(1000)
    lines = [record.getMessage() for record in caplog.records]
    assert lines and all("\r" not in line for line in lines)
    assert any("weights" in line and "100%" in line for line in lines)
