"""Speculative decoding's pieces without a model: the n-gram proposer against a plain
reference, the verify-row arithmetic, the config's errors, the acceptance tracker, and the
rejection sampler's distribution (chi-square against the target's, seeded)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inference.config import EngineConfig
from inference.sampler import (
    Sampler,
    SamplingMetadata,
    apply_top_k_top_p_min_p_reference,
)
from inference.sampling_params import SamplingParams
from inference.sequence import Sequence, SequenceStatus
from inference.spec_decode.config import parse_speculative_config
from inference.spec_decode.drafting import SpecDecoder
from inference.spec_decode.ngram import NgramProposer, TokenHistory
from inference.spec_decode.rejection import verify_rows

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


def reference_proposal(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        starts = [start for start in range(len(tokens) - n - 1, -1, -1)
                  if tokens[start : start + n] == suffix]  # most recent first
        full = [start for start in starts if start + n + k <= len(tokens)]
        if starts:
            start = (full or starts)[0]
            return tokens[start + n : start + n + k]
    return []


def test_proposer_equals_a_plain_search_on_random_histories():
    rng = np.random.default_rng(0)
    proposer = NgramProposer(4, 2, 4)
    for _ in range(400):
        tokens = rng.integers(0, 6, size=int(rng.integers(1, 40))).tolist()
        got = proposer.propose(np.asarray(tokens, dtype=np.int64))
        assert got == reference_proposal(tokens, 4, 2, 4), tokens


def test_proposer_prefers_the_longest_then_the_most_recent_match():
    proposer = NgramProposer(2, 1, 3)
    # "1 2 3" occurs once (followed by 7 8); "3" alone most recently precedes 9.
    tokens = np.array([1, 2, 3, 7, 8, 5, 3, 9, 4, 1, 2, 3])
    assert proposer.propose(tokens) == [7, 8]
    assert NgramProposer(2, 1, 1).propose(tokens) == [9, 4]
    assert proposer.propose(tokens, max_drafts=1) == [7]
    assert proposer.propose(np.array([1, 2, 3])) == []


def test_proposer_reads_a_repeating_run_from_where_k_tokens_follow():
    """Output that repeats a short period: the last occurrence of the suffix is one period
    back, with fewer than k tokens after it; an earlier one proposes all k (the same
    tokens the period continues with)."""
    proposer = NgramProposer(4, 2, 2)
    tokens = np.array([9, 5, 6, 5, 6, 5, 6, 5, 6])
    assert proposer.propose(tokens) == [5, 6, 5, 6]  # from the first 5 6, not the last
    assert proposer.propose(np.array([9, 5, 6, 5, 6])) == [5, 6]  # none has 4 after it
    assert NgramProposer(4, 1, 1).propose(np.array([7, 7, 7, 7, 7, 7])) == [7, 7, 7, 7]


def test_token_history_grows_with_only_the_new_tokens():
    history, tokens = TokenHistory(), []
    for step in range(300):
        tokens.append(step % 7)
        assert history.sync(tokens, len(tokens)).tolist() == tokens
    assert history.sync(tokens + [-1], len(tokens)).tolist() == tokens  # placeholder unread


def test_verify_rows_cover_each_rows_drafts_and_the_one_after():
    rows = verify_rows(np.array([3, 4, 10]), np.array([2, 0, 3]))
    assert rows.tolist() == [1, 2, 3, 4, 7, 8, 9, 10]


@pytest.mark.parametrize("given, message", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "'eagle' needs model: the EAGLE head"),
    ({"method": "mtp", "model": "heads"},
     "'mtp' is not supported yet; supported: ['ngram', 'draft_model', 'eagle', 'eagle3']"),
    ({"method": "eagle", "model": "h", "num_speculative_tokens": 3,
      "draft_tensor_parallel_size": 2}, "the eagle proposer runs on the target's one GPU"),
    ({"method": "mtp"}, "not supported yet"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "needs model"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 3,
      "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size=2 is not supported"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 3,
      "prompt_lookup_max": 3}, "keys ['prompt_lookup_max'] are not supported for method "
     "'draft_model'"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 3},
     "tensor_parallel_size > 1 is not supported"),
    ({"num_speculative_tokens": 3}, "needs a method"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "positive integer"),
    ({**NGRAM, "prompt_lookup_min": 4}, "exceeds prompt_lookup_max"),
    ({**NGRAM, "model": "x"}, "keys ['model'] are not supported"),
    ("{not json", "not JSON"),
])
def test_bad_speculative_configs_say_what_is_supported(given, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        EngineConfig("m", speculative_config=given, tensor_parallel_size=2)


def test_draft_model_configs_as_vllm_spells_them():
    spec = parse_speculative_config(
        '{"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 3}')
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", "/m/draft", 3)
    # vLLM's older spelling: a model and no method is a draft model; "ngram" is the method.
    given = {"model": "/m/draft", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}
    assert parse_speculative_config(given).method == "draft_model"
    old_ngram = {"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    assert parse_speculative_config(old_ngram).method == "ngram"
    assert "model" in old_ngram  # the caller's dict is left as given
    # An EAGLE head: by method, or (vLLM's reading) by a model named for it.
    spec = parse_speculative_config(
        '{"method": "eagle", "model": "/m/head", "num_speculative_tokens": 3}')
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("eagle", "/m/head", 3)
    named = {"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "num_speculative_tokens": 3}
    assert parse_speculative_config(named).method == "eagle"


def test_config_defaults_and_refusals():
    spec = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    assert spec.disable_by_batch_size == 32
    assert parse_speculative_config({**NGRAM, "prompt_lookup_max": 4}).prompt_lookup_min == 1
    EngineConfig("m", speculative_config=NGRAM, tensor_parallel_size=2)  # n-gram: any TP
    with pytest.raises(ValueError, match="speculative_config with enable_lora is not supported"):
        EngineConfig("m", speculative_config=NGRAM, enable_lora=True)


def _decoding_seq(seq_id: int, tokens: list[int], **params) -> Sequence:
    seq = Sequence(seq_id, str(seq_id), 0, tokens, SamplingParams(max_tokens=50, **params))
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = len(tokens) - 1
    return seq


def test_structured_and_penalised_rows_never_draft_and_big_batches_do_not_either():
    decoder = SpecDecoder(parse_speculative_config({**NGRAM, "disable_by_batch_size": 3}))
    prompt = [1, 2, 3, 4, 1, 2, 3]
    plain, penalised = _decoding_seq(0, prompt), _decoding_seq(1, prompt, presence_penalty=0.5)
    constrained = _decoding_seq(2, prompt)
    constrained.grammar = object()
    assert decoder.propose([plain, penalised, constrained]) == 1
    assert plain.draft_token_ids == [4, 1, 2]
    assert penalised.draft_token_ids == constrained.draft_token_ids == []
    crowd = [_decoding_seq(i, prompt) for i in range(4)]
    assert decoder.propose(crowd) == 0


def test_drafts_leave_room_for_the_targets_token_under_max_tokens():
    decoder = SpecDecoder(parse_speculative_config(NGRAM))
    seq = _decoding_seq(0, [1, 2, 3, 4, 1, 2, 3])
    seq.params.max_tokens = 2
    decoder.propose([seq])
    assert seq.draft_token_ids == [4]  # 1 draft + the target's token = max_tokens


def test_a_sequence_whose_drafts_keep_failing_backs_off():
    from inference.sampler import SamplerOutput

    decoder = SpecDecoder(parse_speculative_config(NGRAM))
    seq = _decoding_seq(0, [1, 2, 3, 4, 1, 2, 3])
    for _ in range(3):
        decoder.propose([seq])
        drafts = [list(seq.draft_token_ids)]
        assert drafts[0]
        wrong = [d + 100 for d in drafts[0]] + [0]
        decoder.split(SamplerOutput(wrong, [None] * len(wrong)), [seq], drafts)
    decoder.propose([seq])
    assert seq.draft_token_ids == []
    for _ in range(8):
        decoder.propose([seq])
    assert seq.draft_token_ids  # drafting again after the back-off
    counters = decoder.counters
    assert (counters.num_drafts, counters.num_accepted_tokens) == (3, 0)


def _verify(decoder: SpecDecoder, seq: Sequence, accept: bool) -> None:
    """Propose for ``seq`` (it must draft) and read back a verify that accepted all its
    drafts or none."""
    from inference.sampler import SamplerOutput

    decoder.propose([seq])
    drafts = list(seq.draft_token_ids)
    assert drafts
    picks = (drafts if accept else [d + 100 for d in drafts]) + [0]
    decoder.split(SamplerOutput(picks, [None] * len(picks)), [seq], [drafts])


def test_pipelined_a_sequence_that_never_accepted_backs_off_at_its_first_failure():
    """Pipelined, each failed verify also voids the step after it: a sequence with no draft
    accepted since it started (or resumed) backs off after one failure, one that has
    accepted after three in a row, as unpipelined."""
    decoder = SpecDecoder(parse_speculative_config(NGRAM), pipelined=True)
    fresh = _decoding_seq(0, [1, 2, 3, 4, 1, 2, 3])
    _verify(decoder, fresh, accept=False)
    for _ in range(7):
        decoder.propose([fresh])
        assert fresh.draft_token_ids == []
    _verify(decoder, fresh, accept=False)  # resumed after 8 steps; failed again: 16 now
    for _ in range(15):
        decoder.propose([fresh])
        assert fresh.draft_token_ids == []
    decoder.propose([fresh])
    assert fresh.draft_token_ids

    copying = _decoding_seq(1, [1, 2, 3, 4, 1, 2, 3])
    _verify(decoder, copying, accept=True)
    for _ in range(3):
        _verify(decoder, copying, accept=False)  # drafts after the first and second
    decoder.propose([copying])
    assert copying.draft_token_ids == []
    for _ in range(7):
        decoder.propose([copying])
    _verify(decoder, copying, accept=False)  # resumed: nothing accepted since, one failure
    decoder.propose([copying])
    assert copying.draft_token_ids == []


def _tentatively_extended(seq: Sequence, drafts: list[int]) -> None:
    """As the engine leaves a sequence whose drafts are in flight: taken as accepted,
    pending, the token after them a placeholder."""
    seq.token_ids.extend([*drafts, -1])
    seq.num_pending_tokens += len(drafts) + 1
    seq.num_computed_tokens += len(drafts) + 1


def test_pipelined_a_sequence_that_backed_off_does_not_draft_on_its_drafts_in_flight():
    """Those drafts likely fail, and the step built on them is voided then: a sequence
    that backed off with nothing accepted since sits that step's drafting out; one that
    has not backed off yet drafts on the guess."""
    decoder = SpecDecoder(parse_speculative_config(NGRAM), pipelined=True)
    fresh, resumed = (_decoding_seq(i, [1, 2, 3, 4, 1, 2, 3]) for i in (0, 1))
    _verify(decoder, resumed, accept=False)  # backs off for 8 steps
    for _ in range(7):
        decoder.propose([resumed])
    decoder.propose([fresh, resumed])
    assert fresh.draft_token_ids == resumed.draft_token_ids == [4, 1, 2]
    for seq in (fresh, resumed):
        _tentatively_extended(seq, seq.draft_token_ids)
    decoder.propose([fresh, resumed])
    assert fresh.draft_token_ids  # guessing one token further
    assert resumed.draft_token_ids == []


def _chi_square_p_value(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's test, bins of small expectation merged; p from the regularised upper
    incomplete gamma function (torch, so no SciPy)."""
    keep = expected >= 5
    observed = np.append(observed[keep], observed[~keep].sum())
    expected = np.append(expected[keep], expected[~keep].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


@pytest.mark.parametrize("knobs", [{}, {"top_k": 5}, {"top_p": 0.8}, {"temperature": 0.7}])
def test_rejection_sampling_keeps_the_target_distribution(knobs):
    """Each sample verifies one draft: its first token must follow the target's
    distribution at that position, whatever the draft; accepted drafts are then followed by
    a token of the next position's distribution."""
    torch.manual_seed(0)
    vocab, num_samples = 12, 20000
    logits = torch.randn(2, vocab) * 1.5
    params = SamplingParams(temperature=knobs.get("temperature", 1.0),
                            top_k=knobs.get("top_k", 0), top_p=knobs.get("top_p", 1.0))
    params.all_stop_token_ids = set()
    target = _target_probs(logits, params)
    for draft in (int(target[0].argmax()), int(target[0].argmin())):  # likely, unlikely
        metadata = SamplingMetadata(
            params=[params] * 2 * num_samples, prompt_token_ids=[[]] * 2 * num_samples,
            output_token_ids=[[]] * 2 * num_samples, generators=[None] * 2 * num_samples,
            draft_token_ids=[[draft]] * num_samples,
        )
        picks = Sampler()(logits.repeat(num_samples, 1), metadata).token_ids
        first = np.array(picks[0::2])
        second = np.array(picks[1::2])[first == draft]
        assert _chi_square_p_value(np.bincount(first, minlength=vocab),
                                   target[0] * num_samples) > 1e-4
        if len(second) > 200:
            assert _chi_square_p_value(np.bincount(second, minlength=vocab),
                                       target[1] * len(second)) > 1e-4


def _target_probs(logits: torch.Tensor, params: SamplingParams) -> np.ndarray:
    scaled = logits.double() / params.temperature
    keep = apply_top_k_top_p_min_p_reference(scaled, [params.top_k] * 2, [params.top_p] * 2,
                                             [0.0] * 2)
    probs = scaled.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    return probs.numpy()


def test_greedy_rows_pick_the_argmax_at_every_position():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    params = SamplingParams(temperature=0)
    metadata = SamplingMetadata(params=[params] * 3, prompt_token_ids=[[]] * 3,
                                output_token_ids=[[]] * 3, generators=[None] * 3,
                                draft_token_ids=[[1, 2]])
    assert Sampler()(logits, metadata).token_ids == [1, 0, 2]


def test_a_named_shape_drafts_with_random_weights():
    """Benchmarks: a named shape as the draft loads random weights beside the target's; a
    table of another size with no tokenizer to compare is refused."""
    from inference.model_shapes import SHAPES
    from inference.models.config import ModelConfig
    from inference.spec_decode.draft_model import draft_engine_config

    target_model = ModelConfig.from_dict(SHAPES["qwen2.5-1.5b"])
    target = EngineConfig("m", device="cpu", max_model_len=512).resolve(target_model, "cpu")
    spec = parse_speculative_config(
        {"method": "draft_model", "model": "qwen2.5-1.5b", "num_speculative_tokens": 3})
    config, model_config, _ = draft_engine_config(target, target_model, spec)
    assert config.load_format == "dummy" and config.max_model_len == 512
    assert model_config.vocab_size == target_model.vocab_size
    other = parse_speculative_config(
        {"method": "draft_model", "model": "qwen2.5-7b", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="152064 tokens, the target 151936, and no tokenizer"):
        draft_engine_config(target, target_model, other)
    missing = parse_speculative_config(
        {"method": "draft_model", "model": "/no/such/draft", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="draft model '/no/such/draft': model '/no/such/draft'"
                                         " is not a local folder"):
        draft_engine_config(target, target_model, missing)
