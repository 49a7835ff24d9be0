"""The engine's compiled-kernel cache (TRITON_CACHE_DIR): a folder it cannot write is
replaced by a temporary one with a warning, never a failed start."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from inference.engine_setup import ensure_writable_kernel_cache


def test_writable_cache_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "kernels" / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(path))
    ensure_writable_kernel_cache()
    assert os.environ["TRITON_CACHE_DIR"] == str(path) and path.is_dir()
    assert list(path.iterdir()) == []  # the write probe leaves nothing behind


def test_unwritable_cache_falls_back_to_a_temporary_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    # Under a file: no folder can be made there, also for root (as CI runs).
    monkeypatch.setenv("TRITON_CACHE_DIR", str(blocker / "triton"))
    with caplog.at_level(logging.WARNING):
        ensure_writable_kernel_cache()
    fallback = Path(os.environ["TRITON_CACHE_DIR"])
    assert fallback != blocker / "triton" and fallback.is_dir()
    assert "not writable" in caplog.text


def test_unset_cache_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    ensure_writable_kernel_cache()
    assert "TRITON_CACHE_DIR" not in os.environ
