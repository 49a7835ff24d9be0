"""Schemathesis generates requests from the app's own OpenAPI schema (valid and invalid)
and sends them to a real server: none may answer 5xx."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from server_harness import ServerThread

SCHEMATHESIS = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")


@pytest.fixture(scope="module")
def server(tiny_model):
    # A short max_model_len bounds what a generated request can ask for (max_tokens, n),
    # so the run's length depends on the number of cases, not on luck.
    server = ServerThread(
        tiny_model, served_model_names=["tiny"], max_model_len=64, num_kv_blocks=32,
        max_num_seqs=4,
    ).start()  # fmt: skip
    yield server
    server.stop()


def test_no_server_errors_on_generated_requests(server, tmp_path):
    if not Path(SCHEMATHESIS).exists():
        pytest.skip("schemathesis is not installed")
    cmd = [
        SCHEMATHESIS, "run", f"{server.base_url}/openapi.json",
        "--checks", "not_a_server_error",
        "--phases", "examples,coverage,fuzzing",
        "--max-examples", "30",
        "--seed", "1",
        "--workers", "1",  # its coverage phase is not thread-safe on CPython 3.11
        "--request-timeout", "120",
        "--generation-database", "none",
        "--no-color",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=500, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-12000:] + done.stderr[-2000:]
    server.wait_idle(timeout=120)
    stats = server.engine.stats
    assert stats.num_free_blocks == stats.num_total_blocks
