"""Prompt logprobs (``SamplingParams.prompt_logprobs``) in vLLM's shape, checked against a
transformers float32 forward over the same prompt: under chunked prefill (each chunk adds
its rows), with a prefix another request put in the cache (bypassed: those tokens have no
hidden states), after preemption, with n > 1 and with delta outputs."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model

from inference import LLM, SamplingParams
from inference.sampling_params import RequestOutputKind

TOL = 1e-4
K = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    hf = build_tiny_model(folder, "llama")
    return str(folder), hf


def reference(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def check(prompt_logprobs, prompt: list[int], ref: torch.Tensor, k: int = K) -> None:
    """vLLM's shape (None, then per token a dict holding the prompt token and the top k),
    values within TOL of the reference; ranks and the top k allow for near-ties."""
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entry, row, token = prompt_logprobs[i], ref[i - 1], prompt[i]
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(row[tid].item(), abs=TOL), (i, tid)
            assert lp.decoded_token is not None
        value = row[token]
        rank = entry[token].rank
        assert 1 + int((row > value + TOL).sum()) <= rank <= 1 + int((row > value - TOL).sum())
        top = sorted((lp.rank, lp.logprob) for lp in entry.values() if lp.rank <= k)
        assert [r for r, _ in top] == list(range(1, k + 1))
        torch.testing.assert_close(
            torch.tensor([lp for _, lp in top]), row.topk(k).values, atol=TOL, rtol=0
        )
        assert len(entry) == k + (token not in row.topk(k).indices.tolist())


PROMPT = [(7 * i + 3) % 300 + 3 for i in range(45)]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_chunked_prefill_and_prefix_cache(model, async_scheduling):
    folder, hf = model
    llm = LLM(folder, max_model_len=128, block_size=8, max_num_batched_tokens=16,
              num_kv_blocks=64, async_scheduling=async_scheduling)  # fmt: skip
    ref = reference(hf, PROMPT)
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    # Fill the prefix cache with most of the prompt first.
    warm = llm.generate([PROMPT[:40]], greedy, use_tqdm=False)[0]
    assert warm.prompt_logprobs is None
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=K)
    [out] = llm.generate([PROMPT], params, use_tqdm=False)
    assert out.num_cached_tokens == 0  # prompt logprobs bypass the prefix cache
    check(out.prompt_logprobs, PROMPT, ref)
    # Without prompt logprobs the same prompt is served from the cache.
    again = llm.generate([PROMPT], greedy, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 40
    assert again.outputs[0].token_ids == out.outputs[0].token_ids


def test_preemption_n_and_short_prompts(model):
    folder, hf = model
    # 12 blocks of 8 tokens: eight sequences of up to 75 tokens cannot all fit.
    llm = LLM(folder, max_model_len=96, block_size=8, max_num_batched_tokens=32,
              num_kv_blocks=12, async_scheduling=False)  # fmt: skip
    prompts = [PROMPT, PROMPT[5:], PROMPT[::-1], [42]]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=0,
                            n=2)  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        check(out.prompt_logprobs, prompt, reference(hf, prompt), k=0)
    assert outs[3].prompt_logprobs == [None]


def test_delta_outputs_carry_prompt_logprobs_once(model):
    folder, hf = model
    llm = LLM(folder, max_model_len=128, block_size=8, max_num_batched_tokens=16,
              num_kv_blocks=64)  # fmt: skip
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2,
                            output_kind=RequestOutputKind.DELTA)  # fmt: skip
    engine.add_request("r", PROMPT, params)
    carried = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.prompt_logprobs is not None:
                carried.append((output.outputs[0].token_ids, output.prompt_logprobs))
    assert len(carried) == 1
    first_tokens, prompt_logprobs = carried[0]
    assert len(first_tokens) >= 1  # sent with the first token
    check(prompt_logprobs, PROMPT, reference(hf, PROMPT), k=2)
    assert not engine._unscored  # nothing left to score: steps skip the search


def test_abort_mid_prefill_leaves_nothing_to_score(model):
    folder, _ = model
    llm = LLM(folder, max_model_len=128, block_size=8, max_num_batched_tokens=16,
              num_kv_blocks=64)  # fmt: skip
    engine = llm.engine
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=4, prompt_logprobs=1))
    engine.step()  # the first 16-token chunk of 45
    assert engine._unscored
    engine.abort_request("r")
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine._unscored
