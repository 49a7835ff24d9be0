"""Stop conditions with vLLM's semantics, on a model whose greedy output is scripted
(``build_successor_model``): the continuation of prompt [3, 4, 5] is

    6 "$", 7 "%", 320 "STOPPING" + 32 "x" (one 40-character token), 8 "&", 1 EOS, 5 "#", 6, ...
"""

from __future__ import annotations

import pytest
from tiny_models import build_successor_model

from inference import LLM, RequestOutputKind, SamplingParams

LONG = "STOPPING" + "x" * 32
PROMPT = [3, 4, 5]
EOS = 1


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("successor")
    successors = {5: 6, 6: 7, 7: 320, 320: 8, 8: EOS, EOS: 5}
    tokenizer, _ = build_successor_model(folder, successors, added_tokens=[LONG])
    assert tokenizer.convert_ids_to_tokens(320) == LONG
    return LLM(str(folder), max_model_len=64, block_size=8, num_kv_blocks=32)


def run(llm, **knobs):
    knobs.setdefault("max_tokens", 20)
    params = SamplingParams(temperature=0, **knobs)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]


def test_the_script(llm):
    out = run(llm, max_tokens=7, ignore_eos=True)
    assert out.token_ids == [6, 7, 320, 8, EOS, 5, 6]
    assert out.text == "$%" + LONG + "&#$"


def test_stop_string_at_the_start_of_a_long_token(llm):
    out = run(llm, stop=["STOP"], ignore_eos=True)
    assert (out.finish_reason, out.stop_reason) == ("stop", "STOP")
    assert out.token_ids == [6, 7, 320] and out.text == "$%"
    out = run(llm, stop=["STOP"], ignore_eos=True, include_stop_str_in_output=True)
    assert out.text == "$%STOP"
    # Straddling two tokens, and deep inside the long one.
    assert run(llm, stop=["%ST"], ignore_eos=True).text == "$"
    out = run(llm, stop=["xxx&"], ignore_eos=True)
    assert out.token_ids == [6, 7, 320, 8] and out.text == "$%STOPPING" + "x" * 29


def test_stop_strings_completed_within_min_tokens_are_ignored(llm):
    # "%" completes with token 2: ignored under min_tokens=2; the next "%" (token 8) stops.
    out = run(llm, stop=["%"], min_tokens=2, ignore_eos=True)
    assert len(out.token_ids) == 8 and out.stop_reason == "%"
    assert out.text == "$%" + LONG + "&#$"
    # "%S" completes with token 3, after min_tokens=2: found, reaching back into token 2.
    out = run(llm, stop=["%S"], min_tokens=2, ignore_eos=True)
    assert out.token_ids == [6, 7, 320] and out.text == "$"
    # ... but under min_tokens=3 that occurrence is ignored too.
    out = run(llm, stop=["%S"], min_tokens=3, ignore_eos=True)
    assert len(out.token_ids) == 9 and out.text == "$%" + LONG + "&#$"


def test_stop_token_text_is_dropped_unless_asked_for(llm):
    out = run(llm, stop_token_ids=[320], ignore_eos=True)
    assert out.token_ids == [6, 7, 320] and out.stop_reason == 320
    assert out.text == "$%"
    out = run(llm, stop_token_ids=[320], ignore_eos=True, include_stop_str_in_output=True)
    assert out.text == "$%" + LONG


def test_eos_text_is_dropped_unless_asked_for(llm):
    out = run(llm, skip_special_tokens=False)
    assert out.token_ids == [6, 7, 320, 8, EOS] and out.finish_reason == "stop"
    assert out.text == "$%" + LONG + "&"
    out = run(llm, skip_special_tokens=False, include_stop_str_in_output=True)
    assert out.text == "$%" + LONG + "&</s>"
    # Under ignore_eos it is an ordinary token.
    out = run(llm, max_tokens=6, skip_special_tokens=False, ignore_eos=True)
    assert out.text == "$%" + LONG + "&</s>#"


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize(
    ("stop", "max_tokens", "pieces"),
    [
        # Hold-back 3: LONG's last 3 "x" wait; "&" completes the stop string and cuts them.
        (["xxx&"], 20, ["$%STOPPING" + "x" * 29]),
        # Hold-back 1, never found: the held character goes out when max_tokens ends it.
        (["zz"], 4, ["$", "%STOPPING" + "x" * 31, "x&"]),
    ],
)
def test_delta_text_never_runs_ahead_of_a_stop_string(llm, async_scheduling, stop, max_tokens,
                                                      pieces):  # fmt: skip
    """DELTA outputs (the server's stream) hold back the longest stop string minus one
    character until the completion finishes: text once sent is never cut back."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, stop=stop,
                            output_kind=RequestOutputKind.DELTA)  # fmt: skip
    expected = run(llm, max_tokens=max_tokens, ignore_eos=True, stop=stop)
    engine.async_scheduling = async_scheduling
    sent = []
    try:
        engine.add_request("delta", PROMPT, params)
        while engine.has_unfinished_requests():
            sent += [c.text for out in engine.step() for c in out.outputs]
    finally:
        engine.async_scheduling = True
    assert [piece for piece in sent if piece] == pieces
    assert "".join(pieces) == expected.text


def test_stop_strings_need_detokenization():
    with pytest.raises(ValueError, match="stop strings.*detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
    SamplingParams(stop_token_ids=[3], detokenize=False)  # token ids need no text
