"""What the GPU differential tests share: the engine on CUDA, the tiny models of the matrix
(``models`` fixture in conftest.py), the matrix of engine settings, and one matrix row run
end to end (a seeded random workload through the engine, every KV block back at the end).
Speculative decoding, int4 and FP8 rows run the same rows with one more engine argument."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from differential import (
    Workload,
    check_results_complete,
    engine_args,
    random_workload,
    run_workload,
    settings_matrix,
)

from inference.config import EngineConfig
from inference.llm_engine import LLMEngine

FP32_TOL = 1e-3
MAX_MODEL_LEN = 1536
# Head dims 64 and 128; GQA ratios 1, 2, 4 and 8; q/k norms (Qwen3); q/k/v biases (Qwen2).
# Weights of realistic size (std 0.02), queries and keys scaled until the largest attention
# weight of a row averages 0.5-0.9: sharp, yet not so sharp that float32 rounding alone
# moves a logprob by 1e-3.
MODELS = {
    "llama": dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  qk_scale=5.0),
    "mistral": dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=4,
                    head_dim=128, qk_scale=5.0),
    "qwen2": dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=1,
                  qk_scale=4.0),
    "qwen3": dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                  qk_scale=3.0),
}  # fmt: skip
ARCHS = list(MODELS)


def cuda_engine(folder: str, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(folder, device="cuda", **kwargs))


def _gpu_matrix() -> list[dict]:
    """Budget x caching x async x eager in full; block size and forced preemption each
    cycle through both values across those rows (every pair of them appears)."""
    rows = settings_matrix(block_sizes=(16,), preemption=(False,))
    pairs = list(itertools.product((16, 32), (False, True)))
    for i, row in enumerate(rows):
        row["block_size"], row["preempt"] = pairs[(i + i // 4) % 4]
    return rows


GPU_MATRIX = _gpu_matrix()


def sizes(setting: dict) -> dict:
    """max_num_seqs 48, or the row's token budget when that is smaller (a step holds one
    token per running sequence at least: the engine rejects max_num_seqs above the budget);
    a KV cache of a fixed number of blocks that holds every sequence at full length (unless
    the row forces preemption), so that several engines share a GPU (run_suite.sh): sizing
    from gpu_memory_utilization would count the other processes' caches against this one."""
    max_num_seqs = min(48, setting["max_num_batched_tokens"] or 48)
    blocks = -(-MAX_MODEL_LEN // setting["block_size"]) * max_num_seqs + 64
    return dict(max_num_seqs=max_num_seqs, num_kv_blocks=blocks)


def run_matrix_row(models, index, setting, dtype="float32", quantization=None, seed=2000,
                   folder=None, reshape: Callable[[Workload], Workload] | None = None,
                   **extra):  # fmt: skip
    """Row ``index`` of the matrix on its architecture's model (or the checkpoint in
    ``folder``, e.g. a 4-bit one written from it); ``reshape`` rewrites the workload."""
    arch = ARCHS[index % len(ARCHS)]
    source, model = models[arch]
    engine = cuda_engine(folder or source, dtype=dtype, quantization=quantization,
                         max_model_len=MAX_MODEL_LEN,
                         **{**sizes(setting), **engine_args(setting, MAX_MODEL_LEN), **extra})
    workload = random_workload(
        seed + index, vocab_size=300, max_model_len=MAX_MODEL_LEN,
        block_size=setting["block_size"], num_requests=24, max_new_tokens=24,
    )
    if reshape is not None:
        workload = reshape(workload)
    try:
        results = run_workload(engine, workload)
        check_results_complete(workload, results)
        free, total = engine.block_manager.num_free_blocks, engine.num_total_blocks
        preemptions = engine.stats().num_preemptions_total
    finally:
        engine.shutdown()
    assert free == total
    return arch, model, results, preemptions, workload


def sharp_qwen2(folder, **config):
    """A random Qwen2 with Qwen2.5-1.5B's attention (hidden 1536, 12 query heads, 2 KV
    heads), float32, saved in ``folder``: q/k weights with std 0.05 (the rest 0.02) so
    that attention is sharp and its errors show. ``config``: the rest of the shape."""
    import torch
    import transformers

    config = transformers.Qwen2Config(
        hidden_size=1536, num_attention_heads=12, num_key_value_heads=2,
        tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e6, initializer_range=0.02,
        **config,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.normal_(0, 0.05)
            layer.self_attn.k_proj.weight.normal_(0, 0.05)
    model.save_pretrained(folder)
    return model
