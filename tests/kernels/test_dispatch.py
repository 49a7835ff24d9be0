"""The backend rule: Triton on CUDA or under the interpreter, the reference otherwise."""

import pytest
import torch

from kernels import _backend, rms_norm, rms_norm_ref


def test_interpreter_selects_triton_for_cpu_tensors() -> None:
    assert _backend.use_triton(torch.zeros(1))
    assert _backend.kernel_for("rms_norm", torch.zeros(1)) is not None


def test_disable_flag_forces_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_DISABLE_TRITON", "1")
    assert not _backend.use_triton(torch.zeros(1))
    x, weight = torch.randn(2, 8), torch.ones(8)
    assert torch.equal(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))


def test_cpu_without_interpreter_uses_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not _backend.use_triton(torch.zeros(1))


def test_missing_triton_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_backend, "triton_available", lambda: False)
    assert not _backend.use_triton(torch.zeros(1))
