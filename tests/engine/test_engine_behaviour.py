"""The engine's contract with its callers: sampling options end to end, stop handling,
aborts, and clear errors for bad input that leave other requests untouched."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import build_tiny_model

from inference import LLM, SamplingParams
from inference.config import EngineConfig
from inference.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    build_tiny_model(folder, "llama")
    return LLM(str(folder), max_model_len=128, block_size=8, seed=0)


PROMPTS = [[5, 9, 33, 7], [100, 101, 102, 3, 4, 5, 6], [250, 12]]


def test_seeded_sampling_reproduces_regardless_of_batch(llm):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=24,
                            ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.3, max_tokens=30, ignore_eos=True)
    mixed = llm.generate(
        [PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others, params, others], use_tqdm=False
    )[1].outputs[0].token_ids
    again = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == mixed == again


def test_outputs_in_input_order_and_token_id_prompts(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    assert all(1 <= len(o.outputs[0].token_ids) <= 5 for o in outs)


def test_stop_string_is_trimmed(llm):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate(["The quick brown fox"], greedy, use_tqdm=False)[0].outputs[0]
    text = full.text
    assert len(text) > 6
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    out = llm.generate(["The quick brown fox"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.find(stop)]
    assert stop not in out.text
    kept = SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
    )
    out2 = llm.generate(["The quick brown fox"], kept, use_tqdm=False)[0].outputs[0]
    assert out2.text == text[: text.find(stop) + len(stop)]


def test_stop_token_ids_eos_and_min_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    tokens = llm.generate([PROMPTS[1]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = tokens[3]
    first = tokens.index(stop_id)
    out = llm.generate(
        [PROMPTS[1]],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == tokens[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens forbids the stop token until reached
    out = llm.generate(
        [PROMPTS[1]],
        SamplingParams(temperature=0, max_tokens=20, min_tokens=10, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.token_ids) >= 10 and stop_id not in out.token_ids[:10]
    # length
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=3,
                                                     ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3


def test_eos_finishes_unless_ignored(llm):
    eos = 1
    # A strong repetition penalty on everything but EOS is hard to arrange; instead make EOS
    # the only allowed token through stop ids + min_p: simplest is checking ignore_eos keeps
    # going past an EOS the model produced under sampling.
    params = SamplingParams(temperature=5.0, max_tokens=60, seed=3)
    outs = llm.generate([PROMPTS[0]] * 8, params, use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        if eos in c.token_ids:
            assert c.token_ids[-1] == eos and c.finish_reason == "stop"
            assert c.stop_reason is None
    ignored = SamplingParams(temperature=5.0, max_tokens=60, seed=3, ignore_eos=True)
    for o in llm.generate([PROMPTS[0]] * 8, ignored, use_tqdm=False):
        assert len(o.outputs[0].token_ids) == 60


def test_n_and_logprobs(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, logprobs=3,
                            ignore_eos=True)
    out = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids) == 6
        for tok, entry in zip(c.token_ids, c.logprobs):
            assert tok in entry and 3 <= len(entry) <= 4
            ranks = sorted(lp.rank for lp in entry.values())
            assert ranks[:3] == [1, 2, 3]
            assert all(lp.logprob <= 0 for lp in entry.values())
        assert c.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs))
        )
    # Greedy logprobs: the chosen token is rank 1.
    g = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=4, logprobs=0),
                     use_tqdm=False)[0].outputs[0]
    assert all(e[t].rank == 1 for t, e in zip(g.token_ids, g.logprobs))


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "fox"}],
                   SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "fox"}], add_generation_prompt=True, tokenize=False
    )
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == expected


def test_abort_frees_blocks_at_any_point(llm):
    engine = llm.engine
    free_before = engine.block_manager.num_free_blocks
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"a{i}", prompt, params)
    engine.abort_request("a2")  # still waiting
    outs = engine.step() + engine.step()
    engine.abort_request(["a0", "a1", "unknown"])  # running
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert {o.request_id for o in outs if o.finished} >= {"a0", "a1", "a2"}
    assert all(o.outputs[0].finish_reason == "abort" for o in outs if o.finished)
    assert engine.block_manager.num_free_blocks == free_before


# -- bad input -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"n": 0}, "n"),
        ({"min_p": 2.0}, "min_p"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_requests_leave_others_untouched(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    clean = llm.generate(PROMPTS, params, use_tqdm=False)
    engine.add_request("ok0", PROMPTS[0], params)
    engine.step()
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", list(range(3, 200)), params)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        engine.add_request("long2", PROMPTS[0], SamplingParams(max_tokens=200))
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request("oov", [10**6], params)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok0", PROMPTS[0], params)
    engine.add_request("ok1", PROMPTS[1], params)
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate([PROMPTS[2], list(range(3, 300))], params, use_tqdm=False)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    assert outs.pop("ok0") == clean[0].outputs[0].token_ids
    assert outs.pop("ok1") == clean[1].outputs[0].token_ids
    assert all(tokens == [] for tokens in outs.values())  # the rejected batch ran nothing


def test_unknown_architecture_and_bad_engine_args(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(model="x", block_size=3)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(model="x", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="unknown engine argument"):
        EngineConfig.from_kwargs("x", max_num_seq=3)
    with pytest.raises(ValueError, match="not a local folder|no config.json"):
        LLM(str(tmp_path / "missing"))


def test_kv_cache_smaller_than_max_model_len_is_rejected(tmp_path):
    build_tiny_model(tmp_path, "llama")
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(str(tmp_path), max_model_len=256, block_size=16, num_kv_blocks=4)


def test_dtypes_run(tmp_path):
    build_tiny_model(tmp_path, "qwen2")
    for dtype in ("bfloat16", "float16"):
        llm = LLM(str(tmp_path), dtype=dtype, max_model_len=64)
        assert llm.engine.runner.kv_caches[0][0].dtype == getattr(torch, dtype)
        out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) >= 1


def _run_engine(engine, request_id, prompt, params, async_scheduling=True) -> list:
    engine.async_scheduling = async_scheduling
    outputs = []
    try:
        engine.add_request(request_id, prompt, params)
        while engine.has_unfinished_requests():
            outputs += engine.step()
    finally:
        engine.async_scheduling = True
    return outputs


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_delta_outputs_add_up_to_the_cumulative_output(llm, async_scheduling):
    """RequestOutputKind.DELTA (the server's engine): each step's output holds only new
    token ids, logprobs and text; together they are exactly the finished output."""
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=20, ignore_eos=True,
                            logprobs=2, output_kind=RequestOutputKind.DELTA)  # fmt: skip
    expected = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    outputs = _run_engine(llm.engine, "delta", PROMPTS[1], params, async_scheduling)
    assert len(outputs) > 2 and outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    ids: dict[int, list] = {0: [], 1: []}
    logprobs: dict[int, list] = {0: [], 1: []}
    text = {0: "", 1: ""}
    last = {}
    for out in outputs:
        for c in out.outputs:
            ids[c.index] += c.token_ids
            logprobs[c.index] += c.logprobs
            text[c.index] += c.text
            last[c.index] = c
    for c in expected.outputs:
        assert ids[c.index] == c.token_ids
        assert logprobs[c.index] == c.logprobs
        assert text[c.index] == c.text and last[c.index].finish_reason == "length"


def test_output_kinds(llm):
    """CUMULATIVE (the default): every step's output holds everything so far; FINAL_ONLY:
    one output, at the end; both end with the same output LLM.generate returns."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    cumulative = _run_engine(llm.engine, "cumulative", PROMPTS[0], params)
    assert [len(o.outputs[0].token_ids) for o in cumulative] == list(range(1, 7))
    final = params.clone()
    final.output_kind = RequestOutputKind.FINAL_ONLY
    final_only = _run_engine(llm.engine, "final", PROMPTS[0], final)
    assert len(final_only) == 1 and final_only[0].finished
    for out in (cumulative[-1], final_only[0]):
        c = out.outputs[0]
        assert (c.token_ids, c.text, c.finish_reason) == (
            expected.token_ids, expected.text, expected.finish_reason
        )
