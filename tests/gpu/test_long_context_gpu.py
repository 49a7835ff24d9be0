"""Long context on a CUDA GPU (issue #32's differential rows): prompts of 5k to 13k tokens
through chunked prefill (many chunks, each attending to thousands of cached tokens), the
prefix cache (a 3,001-token prefix shared, not aligned to blocks) and split-KV decode at
that context, against transformers' float32 forward teacher-forced on the engine's tokens.

The model is Qwen2.5-1.5B's attention shape (12 query heads, 2 KV heads, head size 128)
with sharp q/k weights, two layers and a 32k vocabulary: the attention kernels are what
these rows test, and the reference's logits over 13k positions stay small.
"""

from __future__ import annotations

import pytest
import torch
from differential import Reference, Req, Workload, check_results_complete, compare, run_workload
from gpu_matrix import FP32_TOL, cuda_engine, sharp_qwen2

from inference import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (H200 suite)"),
]

MAX_MODEL_LEN = 16384
VOCAB = 32000


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("long-context")
    model = sharp_qwen2(folder, vocab_size=VOCAB, intermediate_size=4096, num_hidden_layers=2,
                        max_position_embeddings=MAX_MODEL_LEN, bos_token_id=1,
                        eos_token_id=2)  # fmt: skip
    return str(folder), Reference(model.to("cuda"), "cuda")


def _long_workload(seed: int) -> Workload:
    gen = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, VOCAB, (n,), generator=gen).tolist()

    prefix = tokens(3001)
    prompts = [prefix + tokens(2000), prefix + tokens(6500), tokens(13000), tokens(4097)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0,
                            detokenize=False)  # fmt: skip
    return Workload([Req(f"long-{i}", p, params) for i, p in enumerate(prompts)])


# Chunks of 2,048 tokens run the paged kernel; of 8,192 over thousands of cached tokens,
# SDPA over the context gathered from the cache (``pagoda_kernels.attention.LongPrefill``).
@pytest.mark.parametrize("block_size,budget", [(16, 2048), (32, 8192)])
def test_long_prompts_fp32(long_model, monkeypatch, block_size, budget):
    import pagoda_kernels.attention as attention

    calls = []
    sdpa = attention._sdpa_prefill
    monkeypatch.setattr(attention, "_sdpa_prefill",
                        lambda q, *args: calls.append(len(q)) or sdpa(q, *args))
    folder, reference = long_model
    engine = cuda_engine(folder, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                         max_num_batched_tokens=budget, enable_prefix_caching=True,
                         block_size=block_size, num_kv_blocks=40960 // block_size)  # fmt: skip
    try:
        workload = _long_workload(block_size)
        results = run_workload(engine, workload)
        check_results_complete(workload, results)
    finally:
        engine.shutdown()
    report = compare(results, reference)
    print(f"\nlong context block {block_size} budget {budget}: {report.summary()}")
    assert report.max_abs_diff <= FP32_TOL, report.summary()
    assert report.argmax_mismatches == 0, report.summary()
    assert any(n >= 2048 for n in calls) == (budget == 8192), calls  # (not the start-up check)
