"""A real Prometheus (Debian's package, which .ci/run installs) for tests: started on a free
port with the given scrape jobs, scraping every second, stopped when the block ends."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from server.server_harness import free_port

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextmanager
def running_prometheus(folder: Path, scrape_configs: str) -> Iterator[str]:
    """Prometheus over ``scrape_configs`` (the YAML list under ``scrape_configs:``, indented
    by two spaces); yields its base URL. Skips the test where the binary is missing."""
    if not shutil.which(PROMETHEUS):
        pytest.skip("the Debian package `prometheus` is not installed (.ci/run installs it)")
    config = folder / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n" + scrape_configs
    )
    port = free_port()
    process = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(process)
