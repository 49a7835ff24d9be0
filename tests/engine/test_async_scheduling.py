"""Async scheduling (step n+1 launched before step n's tokens are read back) must be
invisible to callers: the same outputs as one-step-at-a-time, no placeholder ever leaks into
an output or the prefix cache, and every KV block comes back."""

from __future__ import annotations

import pytest
from tiny_models import build_tiny_model

from inference import LLM, SamplingParams


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-async")
    build_tiny_model(path, "llama")
    return str(path)


def _engines(folder, **kwargs):
    return [
        LLM(folder, max_model_len=128, block_size=8, seed=0, async_scheduling=mode,
            **{"num_kv_blocks": 256, **kwargs})
        for mode in (True, False)
    ]


PROMPTS = [[5, 9, 33, 7], [100, 101, 102, 3, 4, 5, 6], [250, 12], list(range(40, 75))]


def _mixed_params(stop_id: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=25, n=2),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id], min_tokens=3),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, seed=3,
                       max_tokens=20),
    ]


def _summary(outputs):
    return [
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
          None if c.logprobs is None else [sorted(d) for d in c.logprobs])
         for c in o.outputs]
        for o in outputs
    ]


def test_same_outputs_as_synchronous_steps(folder):
    async_llm, sync_llm = _engines(folder)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    stop_id = sync_llm.generate([PROMPTS[2]], greedy, use_tqdm=False)[0].outputs[0].token_ids[6]
    params = _mixed_params(stop_id)
    got = async_llm.generate(PROMPTS, params, use_tqdm=False)
    want = sync_llm.generate(PROMPTS, params, use_tqdm=False)
    assert _summary(got) == _summary(want)
    assert got[2].outputs[0].finish_reason == "stop"  # stopped early, one step wasted
    engine = async_llm.engine
    assert engine.block_manager.num_free_blocks == engine.num_total_blocks


def test_same_outputs_under_preemption(folder):
    async_llm, sync_llm = _engines(folder, num_kv_blocks=18, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [[i + 1, i + 2, i + 3] * 4 for i in range(8)]
    got = async_llm.generate(prompts, params, use_tqdm=False)
    want = sync_llm.generate(prompts, params, use_tqdm=False)
    assert _summary(got) == _summary(want)
    engine = async_llm.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.num_total_blocks
    engine.block_manager.check_invariants([])


def test_no_placeholder_reaches_a_streamed_output_or_the_cache(folder):
    engine = LLM(folder, max_model_len=128, block_size=4, seed=0, num_kv_blocks=256).engine
    assert engine.async_scheduling
    params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids = out.outputs[0].token_ids
            assert all(t >= 0 for t in ids), ids
            if out.finished:
                finals[out.request_id] = ids
    assert sorted(finals) == ["0", "1", "2", "3"]
    assert all(len(ids) == 17 for ids in finals.values()), finals
    for block in engine.block_manager.blocks:
        assert all(t >= 0 for t in block.token_ids), block.token_ids
    # A request repeating a finished one's prompt and output finds them in the cache.
    engine.add_request("again", PROMPTS[3] + finals["3"], SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        outs = engine.step()
    cached = outs[-1].num_cached_tokens
    assert cached >= len(PROMPTS[3]) + 17 - 4, (cached, len(PROMPTS[3]) + 17)


def test_abort_with_a_step_in_flight_frees_everything(folder):
    engine = LLM(folder, max_model_len=128, block_size=8, seed=0, num_kv_blocks=256).engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None
    engine.abort_request([f"r{i}" for i in range(len(PROMPTS))])
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert {o.request_id for o in outs if o.finished} == {f"r{i}" for i in range(len(PROMPTS))}
    assert all(o.outputs[0].finish_reason == "abort" for o in outs)
    assert engine.block_manager.num_free_blocks == engine.num_total_blocks
