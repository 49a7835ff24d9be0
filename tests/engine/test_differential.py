"""The engine against transformers, teacher-forced on the engine's own tokens, over the
matrix of scheduling settings and randomized workloads (``tests/differential.py``).

On CPU there are no CUDA graphs, so ``enforce_eager`` does not enter the matrix here; the
rest does in full: token budget x prefix caching x async scheduling x block size x forced
preemption, each run on its own seeded workload and one of four architectures (sharp
attention, GQA ratios 1 to 8). A smaller share runs the Triton kernels themselves under
Triton's interpreter instead of the torch references. The same harness runs on the GPU in
``tests/gpu/test_differential_gpu.py``.
"""

from __future__ import annotations

import pytest
from differential import (
    Reference,
    check_results_complete,
    compare,
    engine_args,
    random_workload,
    run_workload,
    setting_id,
    settings_matrix,
)
from tiny_models import build_tiny_model

from inference.config import EngineConfig
from inference.llm_engine import LLMEngine

MAX_MODEL_LEN = 192
# Architecture -> shape overrides: head dims 16 and 32, GQA ratios 1, 2, 4 and 8.
MODELS = {
    "llama": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1),
    "mistral": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4),
    "qwen2": dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=1),
    "qwen3": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}
ARCHS = list(MODELS)
# CPU runs eagerly whatever the flag says: the matrix without it.
MATRIX = settings_matrix(enforce_eager=(True,))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    built = {}
    for arch, shape in MODELS.items():
        folder = tmp_path_factory.mktemp(f"diff-{arch}")
        model = build_tiny_model(folder, arch, qk_scale=3.0, seed=11,
                                 max_position_embeddings=MAX_MODEL_LEN, **shape)
        built[arch] = (str(folder), Reference(model))
    return built


def _run(models, index: int, setting: dict, max_model_len: int = MAX_MODEL_LEN,
         seed: int | None = None, **workload_args):  # fmt: skip
    arch = ARCHS[index % len(ARCHS)]
    folder, reference = models[arch]
    config = EngineConfig.from_kwargs(
        folder, device="cpu", max_model_len=max_model_len, max_num_seqs=32,
        **engine_args(setting, max_model_len),
    )
    engine = LLMEngine(config)
    workload = random_workload(
        1000 + index if seed is None else seed, vocab_size=300, max_model_len=max_model_len,
        block_size=setting["block_size"], **workload_args,
    )
    results = run_workload(engine, workload)
    check_results_complete(workload, results)
    report = compare(results, reference)
    context = f"{arch} {setting_id(setting)}: {report.summary()}; workload {workload.describe()}"
    assert report.num_tokens > 0, context
    assert report.max_abs_diff <= 1e-3, context
    assert report.argmax_mismatches == 0, context
    # Nothing leaks: every block is free again (cached prefix blocks count as free).
    assert engine.block_manager.num_free_blocks == engine.num_total_blocks, context
    stats = engine.stats()
    engine.shutdown()
    return stats


@pytest.mark.parametrize(
    "index,setting", list(enumerate(MATRIX)), ids=[setting_id(s) for s in MATRIX]
)
def test_matrix_against_transformers(models, index, setting):
    _run(models, index, setting)


# The Triton kernels' own code (not their references) under the interpreter: slow, so a
# share of the matrix with small workloads (5 requests, prompts of up to 96 tokens), chosen
# to cover every budget, caching and scheduling mode and both block sizes. The "preempt"
# rows' workloads are seeds that do preempt in a cache sized for 104 tokens (most small
# workloads fit, and the row would test nothing of preemption): the test checks they do.
TRITON_SHARE = [
    (dict(max_num_batched_tokens=32, enable_prefix_caching=True, async_scheduling=True,
          enforce_eager=True, block_size=16, preempt=True), 1018),
    (dict(max_num_batched_tokens=256, enable_prefix_caching=False, async_scheduling=False,
          enforce_eager=True, block_size=32, preempt=False), 1001),
    (dict(max_num_batched_tokens=None, enable_prefix_caching=True, async_scheduling=False,
          enforce_eager=True, block_size=32, preempt=True), 1028),
    (dict(max_num_batched_tokens=2048, enable_prefix_caching=True, async_scheduling=True,
          enforce_eager=True, block_size=16, preempt=False), 1003),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "index,setting,seed", [(i, s, seed) for i, (s, seed) in enumerate(TRITON_SHARE)],
    ids=[setting_id(s) for s, _ in TRITON_SHARE],
)  # fmt: skip
def test_triton_kernels_against_transformers(models, monkeypatch, index, setting, seed):
    monkeypatch.setenv("PAGODA_DISABLE_TRITON", "0")  # TRITON_INTERPRET=1 is set for CPU runs
    stats = _run(models, index, setting, max_model_len=104, seed=seed, num_requests=5,
                 max_new_tokens=5, long_prompts=False)  # fmt: skip
    if setting["preempt"]:
        assert stats.num_preemptions_total > 0


# Prefill chunks of 8 query tokens or more run their attention through SDPA over K/V
# gathered from the cache (on a GPU from ``LONG_PREFILL_MIN_QUERIES``; CPU never does by
# itself): chunks over earlier context, prefix-cache hits and preemption's recompute.
SDPA_SHARE = [s for s in MATRIX if setting_id(s) in (
    "budget32-cache-async-eager-bs16-preempt", "budget256-cache-sync-eager-bs32",
    "budgetdefault-nocache-async-eager-bs16")]


@pytest.mark.parametrize("index,setting", list(enumerate(SDPA_SHARE)),
                         ids=[setting_id(s) for s in SDPA_SHARE])
def test_long_prefills_through_sdpa_against_transformers(models, monkeypatch, index, setting):
    import inference.runner.model_runner as model_runner
    import pagoda_kernels.attention as attention

    calls = []
    sdpa = attention._sdpa_prefill
    monkeypatch.setattr(model_runner, "long_prefill_min_queries", lambda *shape: 8)
    monkeypatch.setattr(attention, "LONG_PREFILL_MIN_PAIRS", 0)
    monkeypatch.setattr(attention, "_sdpa_prefill",
                        lambda q, *args: calls.append(len(q)) or sdpa(q, *args))
    _run(models, index, setting)
    assert calls and min(calls) >= 8


def test_harness_sees_a_wrong_kv_read(models, monkeypatch):
    """The suite must be able to fail: an engine that reads one position late in the KV
    cache for chunked prefills (a bug of the kind this suite exists for) is caught."""
    import pagoda_kernels.attention as attention

    real = attention.paged_attention_ref

    def off_by_one(q, k_cache, v_cache, block_tables, seq_lens, *args, **kwargs):
        return real(q, k_cache, v_cache, block_tables, seq_lens - 1 + (seq_lens == 1), *args,
                    **kwargs)

    monkeypatch.setattr(attention, "paged_attention_ref", off_by_one)
    with pytest.raises(AssertionError, match="max \\|dlogprob\\|"):
        _run(models, 0, MATRIX[0])
