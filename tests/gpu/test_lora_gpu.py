"""LoRA on a CUDA GPU: the compiled shrink/expand kernels against float64 at real shapes
(1.5B's qkv and gate/up, 8 slots), and the engine with CUDA graphs (decode and mixed steps
replayed with each step's slot indices) against the merged models, teacher-forced, in
float32; FP8 base weights with adapters in the model's dtype run and the adapters act."""

from __future__ import annotations

import gc

import pytest
import torch
from differential import Reference
from lora_adapters import build_adapter, merged_model
from tiny_models import build_tiny_model

from inference import SamplingParams
from inference.config import EngineConfig
from inference.llm_engine import LLMEngine
from inference.lora.request import LoRARequest
from pagoda_kernels import add_lora

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (H200 suite)"),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)


@pytest.fixture(autouse=True)
def _ieee_fp32_and_free_memory():
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "hidden", "width", "rank"),
                         [(1, 1536, 2048, 48), (64, 1536, 17920, 32), (700, 8960, 1536, 16)])
def test_kernels_match_float64(rows, hidden, width, rank, dtype):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, hidden, device="cuda", generator=g).to(dtype)
    a = (torch.randn(8, rank, hidden, device="cuda", generator=g) / hidden**0.5).to(dtype)
    b = (torch.randn(8, width, rank, device="cuda", generator=g) / rank**0.5).to(dtype)
    y = torch.randn(rows, width, device="cuda", generator=g).to(dtype)
    slots = (torch.arange(rows, device="cuda") % 9 - 1).to(torch.int32)  # 8 adapters + base
    want = y.double().clone()
    used = slots >= 0
    picked = slots[used].long()
    shrunk = torch.einsum("th,tkh->tk", x[used].double(), a[picked].double())
    want[used] += torch.einsum("tk,tnk->tn", shrunk, b[picked].double())
    got = add_lora(y.clone(), x, a, b, slots)
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), err
    assert torch.equal(got[~used], y[~used])


def test_engine_with_cuda_graphs_matches_merged_models(tmp_path):
    hf = build_tiny_model(tmp_path / "base", "qwen2", qk_scale=2.0, seed=7, hidden_size=128,
                          num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=256)  # fmt: skip
    refs, loras = [], [None]
    for i, rank in enumerate((8, 16, 4)):  # merged on the CPU base model, then moved
        adapter = build_adapter(tmp_path / f"a{i}", hf, rank=rank, seed=i + 1)
        loras.append(LoRARequest(f"a{i}", i + 1, str(tmp_path / f"a{i}")))
        refs.append(Reference(merged_model(hf, adapter).cuda(), "cuda"))
    refs.insert(0, Reference(hf.cuda(), "cuda"))  # Module.cuda() moves hf itself: last
    engine = LLMEngine(EngineConfig.from_kwargs(
        str(tmp_path / "base"), device="cuda", dtype="float32", max_model_len=256,
        enable_lora=True, max_loras=2, max_lora_rank=16, max_num_seqs=16,
        max_num_batched_tokens=256, gpu_memory_utilization=0.3))  # fmt: skip
    assert engine.runner.graphs is not None
    prompts = [[(17 * i + 5 * j) % 300 + 3 for j in range(6 + 9 * i)] for i in range(12)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY, lora_request=loras[i % 4])
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
    for i, prompt in enumerate(prompts):
        completion = outputs[f"r{i}"].outputs[0]
        tokens = list(completion.token_ids)
        ref = refs[i % 4].logprobs(prompt, tokens)
        diff = max(abs(d[t].logprob - float(ref[k, t]))
                   for k, (d, t) in enumerate(zip(completion.logprobs, tokens)))  # fmt: skip
        assert diff < 1e-3, (i, diff)
    engine.shutdown()


def test_fp8_base_weights_with_adapters(tmp_path):
    hf = build_tiny_model(tmp_path / "base", "llama", seed=8, hidden_size=128,
                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)  # fmt: skip
    build_adapter(tmp_path / "a", hf, rank=8, seed=9)
    lora = LoRARequest("a", 1, str(tmp_path / "a"))
    engine = LLMEngine(EngineConfig.from_kwargs(
        str(tmp_path / "base"), device="cuda", dtype="bfloat16", quantization="fp8",
        max_model_len=256, enable_lora=True, gpu_memory_utilization=0.3))  # fmt: skip
    prompt = list(range(3, 40))
    engine.add_request("base", prompt, GREEDY)
    engine.add_request("lora", prompt, GREEDY, lora_request=lora)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
    first = [outputs[r].outputs[0].logprobs[0] for r in ("base", "lora")]
    assert first[0] != first[1]
    engine.shutdown()
