"""Kernel tests run the Triton kernels on CPU through Triton's interpreter.

``TRITON_INTERPRET`` is set per test module (and removed afterwards, so tests elsewhere
keep running the fast references on CPU); it is in place before the first Triton dispatch
imports the kernel modules, which is when Triton reads it.
"""

import importlib.util
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter() -> Iterator[None]:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: the kernel tests need its interpreter")
    patch = pytest.MonkeyPatch()
    patch.setenv("TRITON_INTERPRET", "1")
    patch.delenv("PAGODA_DISABLE_TRITON", raising=False)
    yield
    patch.undo()
