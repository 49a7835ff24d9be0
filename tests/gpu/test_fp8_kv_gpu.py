"""FP8 KV cache on a CUDA GPU (``kv_cache_dtype="fp8"``): the compiled kernels, CUDA graphs
and the KV sizing.

- Differential rows (``tests/differential.py``): a float32 engine with an FP8 cache against
  transformers' float32 forward reading its keys and values through the same quantization
  (``fp8_kv_model``), with the CPU suite's bounds (tests/engine/test_fp8_kv_engine.py says
  where they come from): decode in CUDA graphs, split-KV attention, chunked prefill.
- Against bf16 on a random model with realistic weight statistics (std 0.02, Qwen2.5-1.5B's
  head layout): the FP8 cache's blocks take half the bytes, so the KV capacity at the same
  ``gpu_memory_utilization`` is >= 1.9x bf16's, and teacher-forced prompt logprobs over the
  same token sequences stay within a bounded mean |dlogprob| of the bf16 cache's.
"""

from __future__ import annotations

import gc
import os
from dataclasses import replace

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
from tiny_models import build_tiny_model

from inference import LLM, SamplingParams
from inference.config import EngineConfig
from inference.llm_engine import LLMEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (H200 suite)"),
]

MAX_MODEL_LEN = 1024
# The CPU rows' bounds (tests/engine/test_fp8_kv_engine.py).
MEAN_BOUND, MAX_BOUND = 5e-4, 3e-2
# FP8 against bf16 KV on the random model, teacher-forced (mean over every prompt token).
BF16_MEAN_BOUND = 0.05


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8kv-llama")
    model = build_tiny_model(folder, "llama", seed=5, initializer_range=0.02,
                             max_position_embeddings=MAX_MODEL_LEN, hidden_size=512,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                             qk_scale=5.0)  # fmt: skip
    return str(folder), model


ROWS = [
    # decode in CUDA graphs with split-KV, prefix cache, async scheduling
    dict(max_num_batched_tokens=256, enable_prefix_caching=True, async_scheduling=True,
         enforce_eager=False, block_size=16, preempt=False),
    # the default budget, eager, larger blocks, forced preemption
    dict(max_num_batched_tokens=None, enable_prefix_caching=False, async_scheduling=False,
         enforce_eager=True, block_size=32, preempt=True),
]  # fmt: skip


@pytest.mark.parametrize("row", range(len(ROWS)))
def test_fp8_kv_rows_match_the_quantized_reference(sharp, row):
    folder, model = sharp
    setting = ROWS[row]
    sizes = dict(max_num_seqs=32, num_kv_blocks=-(-MAX_MODEL_LEN // setting["block_size"]) * 32)
    engine = LLMEngine(EngineConfig.from_kwargs(
        folder, device="cuda", dtype="float32", kv_cache_dtype="fp8",
        max_model_len=MAX_MODEL_LEN, **{**sizes, **engine_args(setting, MAX_MODEL_LEN)}))
    workload = random_workload(3000 + row, vocab_size=300, max_model_len=MAX_MODEL_LEN,
                               block_size=setting["block_size"], num_requests=24,
                               max_new_tokens=24)  # fmt: skip
    results = run_workload(engine, workload)
    check_results_complete(workload, results)
    engine.shutdown()
    reference = Reference(fp8_kv_model(model).to("cuda").float(), "cuda")
    report = compare(results, reference)
    print(f"\nfp8 KV row {row}: {report.summary()}")
    context = f"{report.summary()}; {workload.describe()}"
    assert report.mean_abs_diff <= MEAN_BOUND, context
    assert report.max_abs_diff <= MAX_BOUND, context
    assert report.argmax_mismatches == 0, context


def profiled_blocks(runner, gpu_memory_utilization: float) -> int:
    """The blocks ``runner``'s memory profile gives at ``gpu_memory_utilization``."""
    runner.config = replace(runner.config, num_kv_blocks=None,
                            gpu_memory_utilization=gpu_memory_utilization)  # fmt: skip
    runner.kv_caches = []
    gc.collect()
    torch.cuda.empty_cache()
    return runner.determine_num_blocks()


def test_fp8_kv_capacity_and_logprobs_against_bf16(tmp_path):
    folder = tmp_path / "qwen2"
    build_tiny_model(folder, "qwen2", seed=7, initializer_range=0.02, num_hidden_layers=4,
                     hidden_size=1536, num_attention_heads=12, num_key_value_heads=2,
                     intermediate_size=4096, max_position_embeddings=MAX_MODEL_LEN)  # fmt: skip
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (40, 200, 700, 90)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    logprobs, blocks = {}, {}
    for kv_cache_dtype in ("auto", "fp8"):
        llm = LLM(str(folder), device="cuda", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
                  max_model_len=MAX_MODEL_LEN, num_kv_blocks=512)  # fmt: skip
        engine = llm.engine
        cache = engine.runner.kv_caches[0][0]
        assert cache.dtype == (torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.bfloat16)
        allocated = sum(k.nbytes + v.nbytes for k, v in engine.runner.kv_caches)
        assert allocated == engine.num_total_blocks * engine.runner.bytes_per_block
        blocks[kv_cache_dtype] = (8 << 30) // engine.runner.bytes_per_block  # at 8 GiB
        outputs = llm.generate(prompts, params, use_tqdm=False)
        logprobs[kv_cache_dtype] = [
            [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], prompt[1:])]
            for out, prompt in zip(outputs, prompts)
        ]
        if os.environ.get("PAGODA_GPU_SHARD") is None:
            # Alone on the GPU (no other shard's memory in the profile): the memory profile
            # itself, at one gpu_memory_utilization.
            blocks[kv_cache_dtype] = profiled_blocks(engine.runner, 0.5)
        llm.engine.shutdown()
        del llm, engine
        gc.collect()
        torch.cuda.empty_cache()
    ratio = blocks["fp8"] / blocks["auto"]
    print(f"\nKV capacity fp8 / bf16: {ratio:.3f}")
    assert ratio >= 1.9
    deltas = [abs(a - b) for xs, ys in zip(logprobs["auto"], logprobs["fp8"])
              for a, b in zip(xs, ys)]  # fmt: skip
    mean = sum(deltas) / len(deltas)
    print(f"fp8 vs bf16 KV, teacher-forced: mean |dlogprob| {mean:.4f}, max {max(deltas):.4f}")
    assert mean <= BF16_MEAN_BOUND
