"""The backend rule: Triton on CUDA or under the interpreter, the reference otherwise."""

import pytest
import torch

from pagoda_kernels import _backend, rms_norm, rms_norm_ref


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


def test_attention_warm_up_is_nothing_where_the_reference_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``kernels.warm_up_paged_attention``: the engine's way to compile the attention
    variants, which does nothing (and says so) where no Triton kernel would run."""
    from pagoda_kernels import warm_up_paged_attention

    monkeypatch.setenv("PAGODA_DISABLE_TRITON", "1")
    cache = torch.zeros(4, 16, 2, 64)
    assert warm_up_paged_attention(cache, cache, 4, 0.125, 64, decode=True) == []


def test_missing_triton_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_backend, "triton_available", lambda: False)
    assert not _backend.use_triton(torch.zeros(1))


def test_fp8_linear_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8: the Triton skinny GEMM up to MAX_M tokens (here: the interpreter), cuBLASLt's
    scaled matmul above it on CUDA with bf16 activations and 16-aligned N and K, the
    reference everywhere else."""
    from pagoda_kernels._triton import fp8_linear as triton_fp8
    from pagoda_kernels.fp8_linear import (
        MAX_M,
        choose_config,
        fp8_linear,
        fp8_linear_ref,
        use_scaled_mm,
    )

    calls: list[int] = []
    original = triton_fp8.fp8_linear
    monkeypatch.setattr(triton_fp8, "fp8_linear", lambda x, *a, **k: (
        calls.append(x.shape[0]), original(x, *a, **k))[1])  # fmt: skip
    weight = torch.randn(16, 32).to(torch.float8_e4m3fn)
    scale = torch.rand(16) + 0.5
    for m in (1, MAX_M, MAX_M + 1):
        x = torch.randn(m, 32)
        out = fp8_linear(x, weight, scale)
        if m > MAX_M:  # CPU: the reference, bit for bit
            assert torch.equal(out, fp8_linear_ref(x, weight, scale))
    assert calls == [1, MAX_M]
    monkeypatch.setenv("PAGODA_DISABLE_TRITON", "1")
    x = torch.randn(2, 32)
    assert torch.equal(fp8_linear(x, weight, scale), fp8_linear_ref(x, weight, scale))
    assert calls == [1, MAX_M]
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert choose_config(1, 3000, 2000, cpu).kind == "fma"  # not in the table: heuristic
    assert choose_config(MAX_M, 3000, 2000, cpu).kind == "dot"
    assert choose_config(MAX_M, 3584, 3584, cpu).kind == "dotq"  # the H200 table
    # float32 activations: float32 sums only (no FP8 MMA), in the table and out of it.
    f32 = torch.float32
    assert choose_config(MAX_M, 3584, 3584, cpu, f32).kind in ("fma", "fmaq")
    assert choose_config(MAX_M, 3000, 2000, cpu, f32).kind == "fma"
    assert choose_config(2, 1536, 1536, cpu, f32).kind == "fmaq"  # an fma kind: kept
    assert choose_config(MAX_M + 1, 3584, 3584, cpu) is None
    assert choose_config(0, 3584, 3584, cpu) is None
    assert use_scaled_mm(3584, 18944, bf16, "cuda")
    assert use_scaled_mm(3584, 18944, torch.float16, "cuda")  # bf16 out, cast to fp16
    assert not use_scaled_mm(3584, 18944, torch.float32, "cuda")  # the exact reference
    assert not use_scaled_mm(3584, 100, bf16, "cuda")  # K not a multiple of 16
    assert not use_scaled_mm(3584, 18944, bf16, "cpu")
