"""4-bit weights (W4A16) on a CUDA GPU: AWQ, GPTQ (act order) and compressed-tensors
checkpoints written from the matrix's models (``tests/int4_checkpoints.py``), run by the
Triton int4 GEMV (decode steps of up to 16 tokens) and GEMM (prefill, larger steps) with
CUDA graphs, chunking, prefix caching, async scheduling and preemption, against
transformers on the weights each checkpoint means (decoded by the format's own definition),
teacher-forced on the engine's tokens. Float32 rows: the kernels' float32 products are
exact, so the fp32 tolerance holds. The bfloat16 row runs Qwen2.5-1.5B's per-layer shapes
(groups of 128, as published releases are): within transformers' own bfloat16 noise."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from differential import Reference, bf16_noise, compare, random_workload, run_workload, setting_id
from gpu_matrix import FP32_TOL, GPU_MATRIX, cuda_engine, run_matrix_row
from int4_checkpoints import write_int4_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (H200 suite)"),
]

# (matrix row, layout, group size): graphs and eager, async and sync, caching, preemption,
# chunked and default budgets, every architecture.
ROWS = [(0, "awq", 32), (6, "gptq-asym-actorder", 64), (9, "ct-sym", 128),
        (19, "gptq-sym", 128), (24, "awq", 64), (13, "ct-actorder", 32)]  # fmt: skip


def _meant_reference(model, meant: dict[str, torch.Tensor], dtype=torch.float32) -> Reference:
    hf = copy.deepcopy(model).float()
    with torch.no_grad():
        for name, weight in meant.items():
            hf.get_parameter(name).copy_(weight)
    return Reference(hf.to("cuda", dtype), "cuda")


@pytest.mark.parametrize("index,layout,group_size", ROWS,
                         ids=[f"{r[1]}-g{r[2]}-row{r[0]}" for r in ROWS])  # fmt: skip
def test_matrix_int4_fp32(models, tmp_path, index, layout, group_size):
    from gpu_matrix import ARCHS

    setting = GPU_MATRIX[index]
    source, model = models[ARCHS[index % len(ARCHS)]]
    folder = tmp_path / layout
    meant = write_int4_checkpoint(Path(source), folder, layout, group_size)
    arch, model, results, _, workload = run_matrix_row(models, index, setting, seed=7000,
                                                       folder=str(folder))  # fmt: skip
    report = compare(results, _meant_reference(model, meant))
    plain = compare(results, Reference(model.to("cuda").float(), "cuda"))
    context = (f"{arch} {layout} g{group_size} {setting_id(setting)}: {report.summary()}; "
               f"{workload.describe()}")  # fmt: skip
    print(f"\n{context}; against full precision: mean {plain.mean_abs_diff:.2e}")
    assert report.max_abs_diff <= 2 * FP32_TOL, context
    assert report.argmax_mismatches == 0, context
    # The 4 bits are visible: the unquantized model is far further away.
    assert plain.mean_abs_diff >= 10 * max(report.mean_abs_diff, 1e-5), (context, plain.summary())


@pytest.mark.parametrize("layout", ["awq", "gptq-asym-actorder"])
def test_real_shapes_int4_bf16(qwen_1p5b_shape, tmp_path, layout):
    folder, reference = qwen_1p5b_shape
    meant = write_int4_checkpoint(Path(folder), tmp_path / layout, layout, 128)
    engine = cuda_engine(str(tmp_path / layout), dtype="bfloat16", max_model_len=1024,
                         max_num_seqs=48, num_kv_blocks=2048)  # fmt: skip
    try:
        # 40 requests: decode steps from 1 to 40 rows (the GEMV up to 16, the GEMM above).
        workload = random_workload(7100, vocab_size=151000, max_model_len=1024, block_size=16,
                                   num_requests=40, max_new_tokens=32)  # fmt: skip
        results = run_workload(engine, workload)
    finally:
        engine.shutdown()
    ref32 = _meant_reference(reference.model, meant)
    ref16 = _meant_reference(reference.model, meant, torch.bfloat16)
    report = compare(results, ref32, tie_tol=0.0)
    noise = bf16_noise(results, ref32, ref16)
    print(f"\n1.5b-shape {layout} bf16: {report.summary()}; hf-bf16 noise {noise:.2e}")
    assert report.mean_abs_diff <= 2 * noise + 1e-3, (report.summary(), noise)
    assert report.max_regret <= max(20 * noise, 0.5), (report.summary(), noise)
