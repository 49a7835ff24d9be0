"""The pre-serialised chunk path writes byte for byte what serialising the whole chunk
payload would (the per-token path builds no dicts)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from inference.server.completions import ChunkEnvelope, choice_end, chunk_payload, dumps, sse


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize(
    "text, logprobs, finish, stop",
    [
        ("Hello", None, None, None),
        (' "quoted" \\ \n ünï 🎉 \u2028', None, None, None),
        ("", None, "stop", "\n\n"),
        ("x", {"tokens": ["x"], "token_logprobs": [-0.5]}, "length", None),
        ("y", None, "stop", 7),
    ],
)
def test_envelope_matches_full_serialisation(include_usage, text, logprobs, finish, stop):
    view = SimpleNamespace(
        request_id="cmpl-1", created=1700000000, model='m "1"', include_usage=include_usage
    )
    choice = {
        "index": 3,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish,
        "stop_reason": stop,
    }
    fragment = f'{{"index":3,"text":{dumps(text)}' + choice_end(logprobs, finish, stop)
    envelope = ChunkEnvelope(view, "text_completion")
    expected = sse(chunk_payload(view, "text_completion", [choice, choice]))
    assert envelope.render([fragment, fragment]) == expected
