"""The grammar bitmask in the sampler: only constrained rows are masked, every pick of a
constrained row is an allowed token (greedy, random, with logprobs), and the mask is filled
lazily, once, when the sampler needs it."""

from __future__ import annotations

import numpy as np
import torch

from inference.sampler import Sampler, SamplingMetadata, apply_token_bitmask
from inference.sampling_params import SamplingParams

VOCAB = 100  # not a multiple of 32: the last word is partly past the vocabulary


def bitmask_of(allowed: list[list[int]]) -> np.ndarray:
    words = np.zeros((len(allowed), (VOCAB + 31) // 32), dtype=np.uint32)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            words[row, t // 32] |= np.uint32(1) << np.uint32(t % 32)
    return words.view(np.int32)


def test_only_constrained_rows_are_masked():
    logits = torch.randn(4, VOCAB)
    allowed = [[0, 31, 32, 99], [5]]  # bit 31 of a word is the int32 sign bit
    masked = apply_token_bitmask(logits.clone(), bitmask_of(allowed), [1, 3])
    for row in (0, 2):
        assert torch.equal(masked[row], logits[row])
    for row, tokens in zip((1, 3), allowed):
        finite = torch.isfinite(masked[row]).nonzero().flatten().tolist()
        assert finite == tokens
        assert torch.equal(masked[row, tokens], logits[row, tokens])


def test_sampled_tokens_are_allowed():
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, logprobs=2),
              SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0.0)]
    allowed = [[7, 8], [1, 50, 98], [3]]
    calls = []

    def fill() -> np.ndarray:
        calls.append(1)
        return bitmask_of(allowed)

    for _ in range(20):
        logits = torch.randn(4, VOCAB, generator=gen)
        metadata = SamplingMetadata(
            params=params, prompt_token_ids=[[]] * 4, output_token_ids=[[]] * 4,
            generators=[None] * 4, bitmask_rows=[0, 1, 2], fill_token_bitmask=fill,
        )
        out = Sampler()(logits, metadata)
        for row, tokens in enumerate(allowed):
            assert out.token_ids[row] in tokens
        # Logprobs describe the constrained distribution: masked tokens have none.
        assert out.logprobs[1].sampled_logprob > float("-inf")
        assert out.logprobs[1].top_logprobs[1] > float("-inf")
        assert out.token_ids[3] == int(logits[3].argmax())  # unconstrained row untouched
    assert len(calls) == 20  # once per step
