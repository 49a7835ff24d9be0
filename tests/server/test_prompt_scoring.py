"""/v1/completions with echo + logprobs: the prompt's own tokens and logprobs come first
(checked against a transformers float32 forward), ``max_tokens: 0`` scores the prompt
alone (lm-eval-harness's local-completions), and text offsets count from the start of the
choice's text, streamed or not."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

PROMPT_IDS = [5, 9, 33, 7, 120, 64, 201, 18, 77, 3, 150, 42]


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def reference(tiny_model) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT_IDS])).logits[0].log_softmax(-1)


def complete(http, **body) -> dict:
    response = http.post("/v1/completions", json={"model": "tiny", "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def stream(http, **body) -> list[dict]:
    chunks = []
    with http.stream(
        "POST", "/v1/completions", json={"model": "tiny", "temperature": 0, "stream": True, **body}
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    return [c for c in chunks if c["choices"]]


def check_offsets(text: str, logprobs: dict, num_prompt: int, prompt_len: int) -> None:
    offsets, tokens = logprobs["text_offset"], logprobs["tokens"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    for i in range(num_prompt - 1):
        assert offsets[i + 1] == offsets[i] + len(tokens[i])
    if len(offsets) > num_prompt:  # the completion's first token starts after the prompt
        assert offsets[num_prompt] == prompt_len
        assert text[prompt_len:].startswith(tokens[num_prompt])


def test_prompt_scoring_matches_transformers(http, reference):
    body = complete(http, prompt=PROMPT_IDS, max_tokens=0, echo=True, logprobs=2)
    [choice] = body["choices"]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(PROMPT_IDS)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for i in range(1, len(PROMPT_IDS)):
        expected = reference[i - 1, PROMPT_IDS[i]].item()
        assert logprobs["token_logprobs"][i] == pytest.approx(expected, abs=1e-4)
        tops = sorted(logprobs["top_logprobs"][i].values(), reverse=True)
        assert tops == pytest.approx(reference[i - 1].topk(len(tops)).values.tolist(), abs=1e-4)
    assert "".join(logprobs["tokens"]) == choice["text"]
    check_offsets(choice["text"], logprobs, len(PROMPT_IDS), len(choice["text"]))
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(PROMPT_IDS)


def test_echo_with_logprobs_puts_the_prompt_first(http, reference):
    body = complete(http, prompt=PROMPT_IDS, max_tokens=4, echo=True, logprobs=1,
                    ignore_eos=True)  # fmt: skip
    plain = complete(http, prompt=PROMPT_IDS, max_tokens=4, logprobs=1, ignore_eos=True)
    [choice], [alone] = body["choices"], plain["choices"]
    logprobs = choice["logprobs"]
    prompt_text = choice["text"][: len(choice["text"]) - len(alone["text"])]
    assert choice["text"] == prompt_text + alone["text"]
    assert len(logprobs["tokens"]) == len(PROMPT_IDS) + 4
    assert logprobs["token_logprobs"][len(PROMPT_IDS):] == alone["logprobs"]["token_logprobs"]
    assert logprobs["token_logprobs"][1] == pytest.approx(
        reference[0, PROMPT_IDS[1]].item(), abs=1e-4
    )
    check_offsets(choice["text"], logprobs, len(PROMPT_IDS), len(prompt_text))
    assert body["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("max_tokens", [0, 5])
def test_streamed_echo_matches_the_full_response(http, max_tokens):
    request = dict(prompt="The quick brown fox", max_tokens=max_tokens, echo=True, logprobs=1,
                   ignore_eos=True)  # fmt: skip
    full = complete(http, **request)["choices"][0]
    chunks = stream(http, **request)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == full["text"]
    assert chunks[0]["choices"][0]["text"].startswith("The quick brown fox")
    merged = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in chunks:
        logprobs = chunk["choices"][0]["logprobs"]
        if logprobs is not None:
            for key in merged:
                merged[key] += logprobs[key]
    assert merged["text_offset"] == full["logprobs"]["text_offset"]
    assert merged["tokens"] == full["logprobs"]["tokens"]
    assert merged["token_logprobs"] == pytest.approx(full["logprobs"]["token_logprobs"])
    if max_tokens:
        # The first streamed token's offset is after the echoed prompt, not 0.
        first_output = len(merged["tokens"]) - max_tokens
        assert merged["text_offset"][first_output] == len("The quick brown fox")
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_max_tokens_zero_needs_echo(http):
    response = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"
