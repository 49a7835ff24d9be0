"""Compiling Triton kernels for an H200 (sm_90) on a machine without a GPU: a script run in
a fresh process without ``TRITON_INTERPRET`` (compiled code, not the interpreter), with the
repository on the path, through the ptxas that ships with Triton."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_compile_script(script: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` as above; skips the test when Triton or its ptxas is missing."""
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
