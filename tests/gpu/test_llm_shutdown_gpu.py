"""On a GPU, ``LLM.shutdown()`` gives back the weights, the KV cache (sized from free
memory by gpu_memory_utilization) and the CUDA graphs: a second ``LLM()`` in the same
process sizes its cache from the memory the first one held (before, it failed with "no
GPU memory left for the KV cache")."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model

from inference import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.gpu_alone,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (H200 suite)"),
]

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_a_second_llm_gets_the_memory_of_the_first(tmp_path):
    build_tiny_model(tmp_path, "llama", head_dim=64, hidden_size=256,
                     num_attention_heads=4, num_key_value_heads=2)
    first = LLM(str(tmp_path), device="cuda", gpu_memory_utilization=0.8, max_model_len=512)
    expected = first.generate([[5, 6, 7]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    held = torch.cuda.memory_allocated()
    first_blocks = first.engine.num_total_blocks
    first.shutdown()
    assert torch.cuda.memory_allocated() < 0.05 * held, "the KV cache was not freed"
    with pytest.raises(RuntimeError, match="shut down"):
        first.generate([[5, 6, 7]], PARAMS, use_tqdm=False)
    with LLM(str(tmp_path), device="cuda", gpu_memory_utilization=0.8,
             max_model_len=512) as second:
        assert second.engine.num_total_blocks >= 0.9 * first_blocks
        again = second.generate([[5, 6, 7]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    assert again == expected
