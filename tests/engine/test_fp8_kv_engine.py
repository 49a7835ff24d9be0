"""``kv_cache_dtype="fp8"`` on CPU, through the kernels' references (and one run through
the Triton kernels under the interpreter).

Differential rows: the engine with an FP8 cache against transformers whose attention
reads its keys and values through the same quantization (``differential.fp8_kv_model``:
divide by the layer's scale, saturate to +-448, round to e4m3, multiply back), float32
everywhere else. The two then differ only where float32 noise in a key or value lands on
the other side of an e4m3 rounding midpoint: one element one e4m3 step off. On the
sharp-attention tiny models (qk_scale 3) that was measured at a mean |dlogprob| of
2e-6..7e-5 and a worst single token of 8.6e-3, while the same FP8 engine against the
unquantized float32 reference is off by a mean of 0.3..0.8 (and the float32 engine
against the quantized reference likewise): the bounds below (mean 5e-4, max 3e-2, no
greedy token that is not the reference's argmax) sit between the two by 3 orders of
magnitude, so the rows check the quantization itself, not just "close to float32".

Engine against engine: FP8 against the float32 cache on a model with ordinary attention
(qk_scale 1) and keys/values of magnitude ~1 (initializer_range 0.1): greedy agreement
and mean |dlogprob| bounded (measured: 36 of 72 greedy tokens before the first
divergence, mean |dlogprob| 0.025 over them; a random two-layer model is chaotic, so
this is a sanity bound: the rows above check the quantization exactly); the cache holds
4x the blocks of a float32 cache (2x bf16's) in the same budget; checkpoint scales load
under vLLM's names and are checked.
"""

from __future__ import annotations

import logging

import pytest
import torch
from differential import (
    Reference,
    check_results_complete,
    compare,
    engine_args,
    fp8_kv_model,
    random_workload,
    run_workload,
)
from safetensors.torch import load_file, save_file
from tiny_models import build_tiny_model

from inference import SamplingParams
from inference.config import EngineConfig
from inference.llm_engine import LLMEngine

MAX_MODEL_LEN = 160
MODELS = {
    "llama": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1),
    "qwen3": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}
MEAN_BOUND, MAX_BOUND = 5e-4, 3e-2


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    built = {}
    for arch, shape in MODELS.items():
        folder = tmp_path_factory.mktemp(f"fp8kv-{arch}")
        model = build_tiny_model(folder, arch, qk_scale=3.0, seed=11,
                                 max_position_embeddings=MAX_MODEL_LEN, **shape)  # fmt: skip
        built[arch] = (folder, model)
    return built


def engine(folder, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(
        str(folder), device="cpu", max_model_len=MAX_MODEL_LEN, max_num_seqs=16, **kwargs))


def run_differential(folder, reference: Reference, seed: int, setting: dict, **workload_args):
    fp8 = engine(folder, kv_cache_dtype="fp8", **engine_args(setting, MAX_MODEL_LEN))
    assert fp8.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    workload = random_workload(seed, vocab_size=300, max_model_len=MAX_MODEL_LEN,
                               block_size=setting["block_size"], **workload_args)  # fmt: skip
    results = run_workload(fp8, workload)
    check_results_complete(workload, results)
    report = compare(results, reference)
    context = f"{report.summary()}; workload {workload.describe()}"
    assert report.num_tokens > 0, context
    assert report.mean_abs_diff <= MEAN_BOUND, context
    assert report.max_abs_diff <= MAX_BOUND, context
    assert report.argmax_mismatches == 0, context
    assert fp8.block_manager.num_free_blocks == fp8.num_total_blocks, context
    fp8.shutdown()
    return results


ROWS = {
    # chunked prefill, prefix caching, async scheduling and preemption (recompute rewrites
    # the quantized cache) on GQA 4:1; the default budget without caching on q/k-norm.
    "llama": dict(max_num_batched_tokens=32, enable_prefix_caching=True, async_scheduling=True,
                  block_size=16, preempt=True),
    "qwen3": dict(max_num_batched_tokens=None, enable_prefix_caching=False,
                  async_scheduling=False, block_size=32, preempt=False),
}  # fmt: skip


@pytest.mark.parametrize("arch", list(ROWS))
def test_fp8_kv_matches_the_quantized_reference(sharp, arch):
    folder, model = sharp[arch]
    results = run_differential(folder, Reference(fp8_kv_model(model)), 2000, ROWS[arch],
                               num_requests=8, max_new_tokens=6)  # fmt: skip
    # The bounds discriminate: against the unquantized model the same tokens are far off.
    assert compare(results, Reference(model)).mean_abs_diff > 20 * MEAN_BOUND


@pytest.mark.slow
def test_fp8_kv_triton_kernels_match_the_quantized_reference(sharp, monkeypatch):
    """The kernels' own code under the interpreter (TRITON_INTERPRET=1 is set for CPU
    runs): the fused rotary + FP8 cache write and FP8 paged attention."""
    monkeypatch.setenv("PAGODA_DISABLE_TRITON", "0")
    folder, model = sharp["llama"]
    setting = dict(ROWS["llama"], preempt=False)
    run_differential(folder, Reference(fp8_kv_model(model)), 2001, setting, num_requests=3,
                     max_new_tokens=3, long_prompts=False)  # fmt: skip


def test_checkpoint_kv_scales_are_loaded_under_vllm_names(sharp, tmp_path):
    """layers.0 has k_scale and v_scale, layers.1 the single kv_scale: both load, and the
    engine matches a reference quantizing with those scales."""
    source, model = sharp["llama"]
    folder = tmp_path / "scaled"
    folder.mkdir()
    for path in source.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.05)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.01)
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor(0.02)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    scales = {0: (0.05, 0.01), 1: (0.02, 0.02)}
    fp8 = engine(folder, kv_cache_dtype="fp8")
    layers = fp8.runner.model.layers
    for index, (k_scale, v_scale) in scales.items():
        assert layers[index].k_scale.item() == pytest.approx(k_scale)
        assert layers[index].v_scale.item() == pytest.approx(v_scale)
    fp8.shutdown()
    setting = dict(max_num_batched_tokens=None, enable_prefix_caching=True,
                   async_scheduling=False, block_size=16, preempt=False)  # fmt: skip
    run_differential(folder, Reference(fp8_kv_model(model, scales)), 2002, setting,
                     num_requests=6, max_new_tokens=6)  # fmt: skip

    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor(-1.0)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="kv_scale: KV-cache scale must be positive"):
        engine(folder, kv_cache_dtype="fp8")


def test_fp8_kv_against_the_float32_engine(tmp_path, caplog):
    """Ordinary attention: the FP8 cache changes few greedy tokens and little logprob, and
    holds 4x the float32 cache's blocks (2x bf16's) in the same memory."""
    folder = tmp_path / "plain"
    build_tiny_model(folder, "llama", seed=3, max_position_embeddings=MAX_MODEL_LEN,
                     initializer_range=0.1, **MODELS["llama"])  # fmt: skip
    prompts = [list(range(3 + i, 40 + 7 * i)) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, ignore_eos=True)
    outputs = {}
    budget = dict(cpu_kv_cache_gib=64 * 1024 / 2**30)  # 64 KiB: the budget binds
    for kv_cache_dtype in ("auto", "fp8"):
        with caplog.at_level(logging.INFO, logger="inference.engine_setup"):
            eng = engine(folder, kv_cache_dtype=kv_cache_dtype, **budget)
        capacity = eng.num_total_blocks, eng.runner.bytes_per_block
        for i, prompt in enumerate(prompts):
            eng.add_request(str(i), prompt, params)
        finished = {}
        while eng.has_unfinished_requests():
            for output in eng.step():
                if output.finished:
                    finished[output.request_id] = output.outputs[0]
        outputs[kv_cache_dtype] = (capacity, finished)
        eng.shutdown()
    (blocks32, bytes32), exact = outputs["auto"]
    (blocks8, bytes8), quantized = outputs["fp8"]
    assert bytes32 == 4 * bytes8 and blocks8 >= 4 * blocks32 - 1
    assert "float8_e4m3fn" in caplog.text  # the start-up log names the cache dtype

    agree = total = 0
    deltas = []
    for i in map(str, range(len(prompts))):
        a, b = exact[i], quantized[i]
        for position, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                break
            agree += 1
            deltas.append(abs(a.logprobs[position][x].logprob - b.logprobs[position][y].logprob))
        total += len(a.token_ids)
    assert agree / total >= 0.35, (agree, total)
    assert sum(deltas) / len(deltas) <= 0.06, sum(deltas) / len(deltas)
