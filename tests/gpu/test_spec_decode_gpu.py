"""Speculative decoding (n-gram) on a CUDA GPU. On the cycling model (a model that copies,
so drafts are accepted) greedy output equals non-speculative decoding token for token, with
CUDA graphs for the plain steps, async scheduling on and off, chunked prefill and
preemption. Over rows of the differential matrix, with prompts that repeat themselves (so
the n-gram finds drafts) and seeded sampling rows, every token's logprob equals
transformers' float32 forward teacher-forced on the engine's tokens, and greedy tokens are
the reference's argmax. EAGLE heads (a head that predicts the cycling model's successors; a
random sharp head on a random target) give the plain engine's greedy output too, with the
target's decode steps in CUDA graphs handing their hidden states to the head."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from differential import Reference, Req, Workload, compare, setting_id
from gpu_matrix import FP32_TOL, GPU_MATRIX, run_matrix_row
from tiny_models import (
    build_eagle3_head,
    build_eagle_head,
    build_successor_eagle3_head,
    build_successor_model,
    build_tiny_model,
)

from inference import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (H200 suite)"),
]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}  # fmt: skip
CYCLES = {10: 11, 11: 12, 12: 13, 13: 14, 14: 10, 20: 21, 21: 22, 22: 1, 1: 20}


@pytest.fixture(scope="module")
def cycling(tmp_path_factory):
    path = tmp_path_factory.mktemp("successor-spec-gpu")
    tokenizer, _ = build_successor_model(path, CYCLES)
    return str(path), tokenizer


def _summary(outputs):
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs]


def _logprobs(outputs) -> list[float]:
    return [d[t].logprob for o in outputs for c in o.outputs if c.logprobs
            for d, t in zip(c.logprobs, c.token_ids)]  # fmt: skip


@pytest.mark.parametrize("engine", [
    {},  # CUDA graphs, async scheduling
    {"async_scheduling": False},
    {"enforce_eager": True},
    {"max_num_batched_tokens": 8, "max_num_seqs": 4},
    {"num_kv_blocks": 14, "max_num_batched_tokens": 16, "max_model_len": 48},  # preemption
])  # fmt: skip
def test_greedy_output_is_unchanged_on_a_copying_model(cycling, engine):
    folder, tokenizer = cycling
    prompts = [[10, 11, 12, 13, 14, 10, 11], [20, 21, 22, 1, 20, 21], [12, 13, 14, 10, 11],
               [10, 11, 12, 13, 14] * 3, [21, 22, 1, 20, 21, 22, 1, 20]] * 4  # fmt: skip
    params = [SamplingParams(temperature=0, max_tokens=23 + i % 7, ignore_eos=i % 2 == 0,
                             logprobs=1, min_tokens=i % 5)
              for i in range(len(prompts))]  # fmt: skip
    settings = {"device": "cuda", "dtype": "float32", "max_model_len": 160, "block_size": 4,
                "seed": 0, "num_kv_blocks": 400, **engine}  # fmt: skip
    with LLM(folder, **settings) as plain:
        want = plain.generate(prompts, params, use_tqdm=False)
    with LLM(folder, speculative_config=NGRAM, **settings) as spec:
        got = spec.generate(prompts, params, use_tqdm=False)
        counters = spec.engine.spec_decoder.counters
        bm = spec.engine.block_manager
        assert bm.num_free_blocks == spec.engine.num_total_blocks
    assert _summary(got) == _summary(want)
    np.testing.assert_allclose(_logprobs(got), _logprobs(want), atol=1e-3)
    assert counters.num_accepted_tokens / counters.num_draft_tokens > 0.5, counters


def _self_repeating(workload: Workload) -> Workload:
    """Each prompt made of its first few tokens over and over (so that the n-gram finds
    matches in the prompt and, once the model repeats, in the output)."""
    rng = np.random.default_rng(1)
    requests = []
    for r in workload.requests:
        unit = r.prompt[: int(rng.integers(2, 9))]
        prompt = (unit * (len(r.prompt) // len(unit) + 1))[: len(r.prompt)]
        requests.append(Req(r.request_id, prompt, r.params, r.arrival_step, r.abort_step))
    return Workload(requests)


@pytest.mark.parametrize("index", [0, 3, 6, 9, 14, 19, 24, 29])
def test_matrix_spec_decode_fp32(models, index):
    setting = GPU_MATRIX[index]
    arch, model, results, _, workload = run_matrix_row(
        models, index, setting, seed=8000, reshape=_self_repeating, speculative_config=NGRAM)
    report = compare(results, Reference(model.to("cuda").float(), "cuda"))
    context = f"{arch} ngram {setting_id(setting)}: {report.summary()}; {workload.describe()}"
    print("\n" + context)
    assert report.max_abs_diff <= FP32_TOL, context
    assert report.argmax_mismatches == 0, context


@pytest.mark.parametrize("engine", [
    {},  # CUDA graphs, async scheduling
    {"async_scheduling": False},
    {"max_num_batched_tokens": 8, "max_num_seqs": 4},  # long catch-ups in chunks
])  # fmt: skip
def test_draft_model_decode_graphs_pick_the_drafts(cycling, engine):
    """A draft model's decode graphs end in its LM head and argmax, each fed the previous
    forward's picks on the device: with the cycling model as its own draft nearly every
    draft is accepted (a wrong pick or placeholder would show as rejections), and the
    output is the plain engine's."""
    folder, _ = cycling
    prompts = [[10, 11, 12, 13, 14, 10, 11], [20, 21, 22, 1, 20, 21], [12, 13, 14, 10, 11],
               [10, 11, 12, 13, 14] * 3] * 2  # fmt: skip
    params = [SamplingParams(temperature=0, max_tokens=20 + i, ignore_eos=True, logprobs=1)
              for i in range(len(prompts))]  # fmt: skip
    settings = {"device": "cuda", "dtype": "float32", "max_model_len": 160, "block_size": 4,
                "seed": 0, "num_kv_blocks": 400, **engine}  # fmt: skip
    draft = {"method": "draft_model", "model": folder, "num_speculative_tokens": 4}
    with LLM(folder, **settings) as plain:
        want = plain.generate(prompts, params, use_tqdm=False)
    with LLM(folder, speculative_config=draft, **settings) as spec:
        assert spec.engine.spec_decoder.draft.runner.graphs is not None
        got = spec.generate(prompts, params, use_tqdm=False)
        counters = spec.engine.spec_decoder.counters
    assert _summary(got) == _summary(want)
    np.testing.assert_allclose(_logprobs(got), _logprobs(want), atol=1e-3)
    assert counters.num_accepted_tokens / counters.num_draft_tokens > 0.9, counters


# -- draft_model: the target as its own draft (drafts accepted) and the matrix's model of
# another architecture's weights would differ in vocabulary; so a perturbed copy instead.
def _perturbed_copy(source: str, folder) -> str:
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    (weights,) = Path(folder).glob("*.safetensors")
    tensors = load_file(weights)
    gen = torch.Generator().manual_seed(3)
    for name, tensor in tensors.items():
        if name.endswith("mlp.down_proj.weight"):
            tensors[name] = tensor + 0.5 * tensor.std() * torch.randn(tensor.shape, generator=gen)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return str(folder)


@pytest.mark.parametrize("index,draft", [(1, "self"), (7, "perturbed"), (20, "self"),
                                          (26, "perturbed")])  # fmt: skip
def test_matrix_draft_model_fp32(models, tmp_path, index, draft):
    from gpu_matrix import ARCHS

    setting = GPU_MATRIX[index]
    source = models[ARCHS[index % len(ARCHS)]][0]
    folder = source if draft == "self" else _perturbed_copy(source, tmp_path / "draft")
    config = {"method": "draft_model", "model": folder, "num_speculative_tokens": 3}
    arch, model, results, _, workload = run_matrix_row(
        models, index, setting, seed=8500, speculative_config=config)
    report = compare(results, Reference(model.to("cuda").float(), "cuda"))
    context = (f"{arch} draft {draft} {setting_id(setting)}: {report.summary()}; "
               f"{workload.describe()}")  # fmt: skip
    print("\n" + context)
    assert report.max_abs_diff <= FP32_TOL, context
    assert report.argmax_mismatches == 0, context


# -- eagle: a head that predicts the cycling model's successors (drafts accepted), and a
# random head on a random target (mostly rejected); greedy output as without speculation.
@pytest.fixture(scope="module")
def eagle_heads(tmp_path_factory, cycling):
    folder, _ = cycling
    cycling_head = tmp_path_factory.mktemp("eagle-cycling-head")
    build_eagle_head(cycling_head, folder, fc_bias=False, zero_outputs=True,
                     fc=torch.cat([torch.eye(64), torch.zeros(64, 64)], dim=1))
    target = tmp_path_factory.mktemp("eagle-random-target")
    build_tiny_model(target, "llama", qk_scale=2.0)
    random_head = tmp_path_factory.mktemp("eagle-random-head")
    build_eagle_head(random_head, target, seed=5, qk_scale=3.0)
    # EAGLE-3: the head that drafts the cycling model's token after next (one draft a step,
    # always accepted), and a random head over the random target's layer 1 (its only
    # inner layer) on a target state the CUDA graphs record.
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    cycling3 = tmp_path_factory.mktemp("eagle3-cycling-head")
    build_successor_eagle3_head(cycling3, folder, model, CYCLES)
    random3 = tmp_path_factory.mktemp("eagle3-random-head")
    build_eagle3_head(random3, target, seed=5, qk_scale=3.0, aux_layers=[1, 1, 1])
    return {"cycling": (folder, str(cycling_head)), "random": (str(target), str(random_head)),
            "cycling-eagle3": (folder, str(cycling3)), "random-eagle3": (str(target), str(random3))}


@pytest.mark.parametrize("pair", ["cycling", "random", "cycling-eagle3", "random-eagle3"])
@pytest.mark.parametrize("engine", [
    {},  # CUDA graphs, async scheduling
    {"async_scheduling": False},
    {"max_num_batched_tokens": 8, "max_num_seqs": 4},
    {"num_kv_blocks": 14, "max_num_batched_tokens": 16, "max_model_len": 48},  # preemption
])  # fmt: skip
def test_eagle_greedy_output_is_unchanged(eagle_heads, pair, engine):
    folder, head = eagle_heads[pair]
    prompts = [[10, 11, 12, 13, 14, 10, 11], [20, 21, 22, 1, 20, 21], [12, 13, 14, 10, 11],
               [10, 11, 12, 13, 14] * 3, [21, 22, 1, 20, 21, 22, 1, 20]] * 4  # fmt: skip
    params = [SamplingParams(temperature=0, max_tokens=23 + i % 7, ignore_eos=i % 2 == 0,
                             logprobs=1, min_tokens=i % 5)
              for i in range(len(prompts))]  # fmt: skip
    settings = {"device": "cuda", "dtype": "float32", "max_model_len": 160, "block_size": 4,
                "seed": 0, "num_kv_blocks": 400, **engine}  # fmt: skip
    method = "eagle3" if pair.endswith("eagle3") else "eagle"
    eagle = {"method": method, "model": head,
             "num_speculative_tokens": 1 if pair == "cycling-eagle3" else 3}
    with LLM(folder, **settings) as plain:
        want = plain.generate(prompts, params, use_tqdm=False)
    with LLM(folder, speculative_config=eagle, **settings) as spec:
        got = spec.generate(prompts, params, use_tqdm=False)
        counters = spec.engine.spec_decoder.counters
        assert spec.engine.runner.graphs is not None or engine.get("enforce_eager")
        assert spec.engine.block_manager.num_free_blocks == spec.engine.num_total_blocks
    assert _summary(got) == _summary(want)
    np.testing.assert_allclose(_logprobs(got), _logprobs(want), atol=1e-3)
    assert counters.num_draft_tokens > 0, counters
    if pair == "cycling":
        assert counters.num_accepted_tokens / counters.num_draft_tokens > 0.8, counters
