"""The batched sampler against straightforward references and hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties,
    apply_top_k_top_p_min_p,
    apply_top_k_top_p_min_p_reference,
)
from inference.sampling_params import SamplingParams

# Derandomized: the same examples on every run, so a float rounding tie at a top-p boundary
# cannot make CI flaky.
FAST = settings(max_examples=60, deadline=None, derandomize=True)


def _metadata(
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplingMetadata:
    batch = len(params)
    return SamplingMetadata(
        params=params,
        prompt_token_ids=prompts or [[] for _ in range(batch)],
        output_token_ids=outputs or [[] for _ in range(batch)],
        generators=generators or [None] * batch,
    )


def _seeded(seed: int, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def test_all_greedy_is_argmax() -> None:
    logits = torch.randn(8, 50, generator=_seeded(0))
    params = [SamplingParams(temperature=0.0) for _ in range(8)]
    out = Sampler()(logits, _metadata(params))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8


def test_greedy_rows_in_mixed_batch_are_argmax() -> None:
    logits = torch.randn(6, 50, generator=_seeded(1))
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.3, top_k=5) for i in range(6)]
    out = Sampler()(logits, _metadata(params))
    for row in range(1, 6, 2):
        assert out.token_ids[row] == int(logits[row].argmax())


def _run_request(seed: int, steps: list[torch.Tensor], row: int, mates: list[SamplingParams]):
    """Sample `steps` for one seeded request placed at `row` among unseeded batch-mates."""
    mine = SamplingParams(temperature=0.8, top_p=0.9, seed=seed)
    generator = _seeded(seed)
    tokens = []
    for step_logits in steps:
        params = mates[:row] + [mine] + mates[row:]
        gens = [None] * len(params)
        gens[row] = generator
        batch = torch.randn(len(params), step_logits.shape[0])
        batch[row] = step_logits
        tokens.append(Sampler()(batch, _metadata(params, generators=gens)).token_ids[row])
    return tokens


@given(
    seed=st.integers(0, 2**31),
    num_mates=st.integers(0, 5),
    row_fraction=st.floats(0, 1),
    mate_temperature=st.sampled_from([0.0, 0.7, 1.5]),
)
@FAST
def test_seeded_request_ignores_batch_mates_and_position(
    seed: int, num_mates: int, row_fraction: float, mate_temperature: float
) -> None:
    # Flat logits so that the noise, not the distribution, decides the tokens.
    steps = [0.1 * torch.randn(40, generator=_seeded(seed + i)) for i in range(4)]
    alone = _run_request(seed, steps, 0, [])
    mates = [SamplingParams(temperature=mate_temperature, top_k=3) for _ in range(num_mates)]
    row = round(row_fraction * num_mates)
    assert _run_request(seed, steps, row, mates) == alone


def test_seeded_row_uses_one_exponential_draw_per_step_from_its_generator() -> None:
    logits = torch.randn(3, 30, generator=_seeded(2))
    params = [SamplingParams(temperature=0.7, seed=11) for _ in range(3)]
    gens = [_seeded(11), None, _seeded(12)]
    twin = _seeded(11)
    for _ in range(3):
        got = Sampler()(logits, _metadata(params, generators=gens)).token_ids[0]
        noise = torch.empty(30).exponential_(generator=twin)
        assert got == int(((logits[0] / 0.7).softmax(-1) / noise).argmax())


_truncation_rows = st.tuples(
    st.integers(-1, 12),
    st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.3, 0.05]),
    st.sampled_from([0.0, 0.01, 0.1, 0.5]),
)


@given(
    seed=st.integers(0, 2**31),
    vocab_size=st.integers(1, 40),
    scale=st.sampled_from([0.1, 1.0, 4.0]),
    rows=st.lists(_truncation_rows, min_size=1, max_size=6),
    sort_path=st.booleans(),
)
@FAST
def test_truncation_masks_equal_reference(
    seed: int, vocab_size: int, scale: float, rows: list, sort_path: bool
) -> None:
    logits = scale * torch.randn(len(rows), vocab_size, generator=_seeded(seed))
    top_k, top_p, min_p = (list(column) for column in zip(*rows, strict=True))
    if not sort_path:  # top-k alone goes through torch.topk rather than a full sort
        top_p = [1.0] * len(rows)
    enabled_k = [k for k in top_k if 0 < k < vocab_size]
    out = apply_top_k_top_p_min_p(
        logits,
        top_k=torch.tensor(top_k),
        top_p=torch.tensor(top_p) if sort_path else None,
        min_p=torch.tensor(min_p),
        max_top_k=max(enabled_k, default=None),
    )
    expected = apply_top_k_top_p_min_p_reference(logits, top_k, top_p, min_p)
    assert torch.equal(torch.isfinite(out), expected)
    assert torch.equal(out[expected], logits[expected])


def test_truncation_reference_on_hand_example() -> None:
    logits = torch.tensor([[math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]])
    keep = apply_top_k_top_p_min_p_reference(logits, [0], [0.8], [0.0])
    assert keep.tolist() == [[True, True, False, False]]  # 0.5 + 0.3 reaches 0.8
    keep = apply_top_k_top_p_min_p_reference(logits, [0], [1.0], [0.2])
    assert keep.tolist() == [[True, True, True, False]]  # 0.05 < 0.2 * 0.5
    keep = apply_top_k_top_p_min_p_reference(logits, [1], [0.1], [0.0])
    assert keep.tolist() == [[True, False, False, False]]


def test_min_p_comes_before_top_p_as_in_vllm_v1() -> None:
    # min_p = 0.3 drops 0.1 (< 0.3 * 0.4); the rest renormalises to (0.44, 0.33, 0.22), of
    # which top_p = 0.75 keeps two. Top-p on the full distribution would have kept three.
    logits = torch.tensor([[math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]])
    expected = [[True, True, False, False]]
    keep = apply_top_k_top_p_min_p_reference(logits, [0], [0.75], [0.3])
    assert keep.tolist() == expected
    out = apply_top_k_top_p_min_p(logits, top_p=torch.tensor([0.75]), min_p=torch.tensor([0.3]))
    assert torch.isfinite(out).tolist() == expected
    # min-p measures against the largest probability of the whole distribution, so with
    # top-k it keeps the same tokens in either order.
    out = apply_top_k_top_p_min_p(
        logits, top_k=torch.tensor([3]), min_p=torch.tensor([0.6]), max_top_k=3
    )
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]


def test_top_p_stops_once_the_mass_reaches_top_p() -> None:
    # Four equal probabilities of exactly 0.25: two tokens reach top_p = 0.5, a third is too many.
    logits = torch.zeros(1, 4)
    out = apply_top_k_top_p_min_p(logits, top_p=torch.tensor([0.5]))
    assert int(torch.isfinite(out).sum()) == 2
    assert int(apply_top_k_top_p_min_p_reference(logits, [0], [0.5], [0.0]).sum()) == 2


def _penalize(logits: list[float], prompt: list[int], output: list[int], **knobs: float):
    return apply_penalties(
        torch.tensor([logits]),
        [prompt],
        [output],
        torch.tensor([knobs.get("repetition", 1.0)]),
        torch.tensor([knobs.get("frequency", 0.0)]),
        torch.tensor([knobs.get("presence", 0.0)]),
    )[0].tolist()


def test_repetition_penalty_by_hand() -> None:
    # Token 0 (positive, in prompt) is divided, token 1 (negative, in output) is multiplied,
    # tokens 2 and 3 never appeared and keep their logits.
    got = _penalize([2.0, -1.0, 3.0, -0.5], prompt=[0], output=[1, 1], repetition=2.0)
    assert got == pytest.approx([1.0, -2.0, 3.0, -0.5])


def test_frequency_penalty_by_hand() -> None:
    # Counts only output tokens: token 1 twice, token 2 once; token 0 is prompt-only.
    got = _penalize([1.0, 1.0, 1.0, 1.0], prompt=[0], output=[1, 2, 1], frequency=0.5)
    assert got == pytest.approx([1.0, 0.0, 0.5, 1.0])


def test_presence_penalty_by_hand() -> None:
    got = _penalize([1.0, 1.0, 1.0, 1.0], prompt=[0], output=[1, 2, 1], presence=0.5)
    assert got == pytest.approx([1.0, 0.5, 0.5, 1.0])


def _penalty_reference(logits, prompt, output, repetition, frequency, presence):
    out = list(logits)
    for token in range(len(out)):
        if token in prompt or token in output:
            out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
        out[token] -= frequency * output.count(token) + presence * (token in output)
    return out


@given(
    seed=st.integers(0, 2**31),
    rows=st.lists(
        st.tuples(
            st.lists(st.integers(0, 9), max_size=6),
            st.lists(st.integers(0, 9), max_size=6),
            st.floats(0.5, 2.0),
            st.floats(-2.0, 2.0),
            st.floats(-2.0, 2.0),
        ),
        min_size=1,
        max_size=5,
    ),
)
@FAST
def test_penalties_equal_per_token_reference(seed: int, rows: list) -> None:
    logits = torch.randn(len(rows), 10, generator=_seeded(seed))
    prompts, outputs, rep, freq, pres = (list(column) for column in zip(*rows, strict=True))
    got = apply_penalties(
        logits, prompts, outputs, torch.tensor(rep), torch.tensor(freq), torch.tensor(pres)
    )
    for row, args in enumerate(rows):
        expected = _penalty_reference(logits[row].tolist(), *args)
        assert got[row].tolist() == pytest.approx(expected, abs=1e-5)


def test_sampler_applies_penalties_before_greedy_argmax() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=2.0)]
    out = Sampler()(logits, _metadata(params, outputs=[[0]], prompts=[[1]]))
    assert out.token_ids == [1]  # 5 - 2 < 4


def test_min_tokens_masks_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]] * 2)
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    params.all_stop_token_ids = {1}
    early = Sampler()(logits, _metadata([params, params], outputs=[[3], [3, 3]]))
    assert early.token_ids == [3, 1]  # row 0 is below min_tokens: both stop ids are masked
    hot = SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=[2], seed=0)
    hot.all_stop_token_ids = {1}
    for seed in range(20):
        meta = _metadata([hot], outputs=[[]], generators=[_seeded(seed)])
        assert Sampler()(logits[:1], meta).token_ids[0] not in (1, 2)


def test_logprobs_come_from_raw_logits() -> None:
    logits = torch.randn(4, 25, generator=_seeded(3))
    params = [
        SamplingParams(temperature=0.5, top_k=3, logprobs=5, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, logprobs=2),
    ]
    out = Sampler()(logits, _metadata(params, prompts=[[0, 1]] * 4))
    raw = logits.log_softmax(-1)
    assert out.logprobs[2] is None
    for row in (0, 1, 3):
        row_lp = out.logprobs[row]
        token = out.token_ids[row]
        assert row_lp.sampled_logprob == pytest.approx(raw[row, token].item(), abs=1e-6)
        assert row_lp.sampled_rank == 1 + int((raw[row] > raw[row, token]).sum())
        top = raw[row].topk(params[row].logprobs)
        assert row_lp.top_token_ids == top.indices.tolist()
        assert row_lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)
    assert out.logprobs[1].sampled_rank == 1 and out.logprobs[1].top_token_ids == []


@pytest.mark.parametrize(
    ("knobs", "expected"),
    [
        ({"temperature": 1.0}, [0.5, 0.3, 0.2]),
        ({"temperature": 0.5}, [0.25 / 0.38, 0.09 / 0.38, 0.04 / 0.38]),
        ({"temperature": 1.0, "top_k": 2}, [0.625, 0.375, 0.0]),
        ({"temperature": 1.0, "top_p": 0.6}, [0.625, 0.375, 0.0]),
        ({"temperature": 1.0, "min_p": 0.5}, [0.625, 0.375, 0.0]),
        # min-p first (drops 0.2 < 0.5 * 0.5), then top-p over the rest: 0.625 reaches 0.6.
        # Top-p first would have kept two tokens (0.5 < 0.6).
        ({"temperature": 1.0, "min_p": 0.5, "top_p": 0.6}, [1.0, 0.0, 0.0]),
    ],
)
def test_sampling_frequencies_match_distribution(knobs: dict, expected: list[float]) -> None:
    draws = 20_000
    logits = torch.tensor([[math.log(p) for p in (0.5, 0.3, 0.2)]]).expand(draws, 3)
    params = [SamplingParams(**knobs, seed=row) for row in range(draws)]
    gens = [_seeded(row) for row in range(draws)]
    tokens = torch.tensor(Sampler()(logits, _metadata(params, generators=gens)).token_ids)
    frequencies = torch.bincount(tokens, minlength=3).double() / draws
    # 0.02 is more than five standard deviations of a frequency over 20,000 draws.
    assert frequencies.tolist() == pytest.approx(expected, abs=0.02)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    logits = torch.randn(5, 1000, device="cuda")
    mine = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, logprobs=3, seed=7)
    others = [SamplingParams(temperature=t, repetition_penalty=1.2) for t in (0.0, 1.0, 0.5, 2)]
    alone = Sampler()(logits[2:3], _metadata([mine], generators=[_seeded(7, "cuda")]))
    params = others[:2] + [mine] + others[2:]
    gens = [None, None, _seeded(7, "cuda"), None, None]
    batch = Sampler()(logits, _metadata(params, prompts=[[1, 2]] * 5, generators=gens))
    assert batch.token_ids[2] == alone.token_ids[0]
    assert batch.logprobs[2] == alone.logprobs[0]
    assert batch.token_ids[0] == int(logits[0].argmax())


def test_logit_bias_forces_and_bans_tokens_per_row():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    best = int(logits[1].argmax())
    params = [
        SamplingParams(temperature=0.0, logit_bias={7: 100.0}),  # forced
        SamplingParams(temperature=0.0, logit_bias={best: -100.0}),  # its argmax banned
        SamplingParams(temperature=0.8, seed=1, logit_bias={3: 100.0, 60: 5.0}),  # 60: beyond V
    ]
    generators = [None, None, torch.Generator().manual_seed(1)]
    output = Sampler()(logits, _metadata(params, generators=generators))
    assert output.token_ids[0] == 7
    assert output.token_ids[1] == int(
        logits[1].clone().index_fill_(0, torch.tensor(best), -1e9).argmax()
    )
    assert output.token_ids[2] == 3


def test_logit_bias_is_validated():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: 101.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
