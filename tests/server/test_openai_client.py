"""The official `openai` client against a real uvicorn server on loopback, serving the
embedded SmolLM2 model: completions, chat, streaming, n, stop, logprobs, usage."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_harness import ServerThread

MODEL = "smollm2"


@pytest.fixture(scope="module")
def server(smol_model):
    server = ServerThread(
        smol_model, served_model_names=[MODEL], max_model_len=512, num_kv_blocks=256
    ).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=120) as c:
        yield c


def test_models_lists_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_answers_coherently(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0.0,
    )
    choice = response.choices[0]
    assert "paris" in choice.message.content.lower()
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage.prompt_tokens > 10
    assert 0 < usage.completion_tokens <= 24
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion_usage_and_length(client):
    response = client.completions.create(
        model=MODEL, prompt="The three primary colors are", max_tokens=8, temperature=0.0
    )
    assert response.object == "text_completion"
    choice = response.choices[0]
    assert choice.text
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 8


def test_greedy_is_deterministic_and_matches_streaming(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.0)
    full = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == full
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count from one to five."}],
        max_tokens=16,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) > 1, "tokens must stream as they are produced"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 16 or any(
        c.choices and c.choices[0].finish_reason == "stop" for c in chunks
    )
    assert all(c.usage is None for c in chunks[:-1])


def test_n_2_returns_two_choices(client):
    response = client.completions.create(
        model=MODEL, prompt="My favourite animal is", max_tokens=6, n=2, temperature=1.0, seed=3
    )
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert 2 <= response.usage.completion_tokens <= 12


def test_n_2_streaming(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=5,
            n=2,
            stream=True,
        )
    )
    finished = {choice.index for c in chunks for choice in c.choices if choice.finish_reason}
    assert finished == {0, 1}


def test_seed_makes_sampling_reproducible(client):
    kwargs = dict(model=MODEL, prompt="A random word:", max_tokens=8, temperature=1.0, seed=42)
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first


def test_stop_string_ends_generation(client):
    response = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0.0, stop=[" 7"]
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert " 7" not in choice.text
    assert "6" in choice.text


def test_completion_logprobs(client):
    response = client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=4, temperature=0.0, logprobs=3
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == 4
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert all(lp <= 0.0 for lp in logprobs.token_logprobs)
    for token, lp, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert len(top) == 3
        # Greedy: the chosen token is the most likely one.
        assert max(top.values()) == pytest.approx(lp, abs=1e-4)
        assert token in top


def test_chat_logprobs(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=4,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
    )
    content = response.choices[0].logprobs.content
    assert 1 <= len(content) <= 4
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_token_id_prompt_and_tokenize_roundtrip(server, client):
    tokens = httpx.post(
        f"{server.base_url}/tokenize", json={"model": MODEL, "prompt": "Hello world"}
    ).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=tokens, max_tokens=5, temperature=0)
    by_text = client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=5, temperature=0
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(tokens)
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens}).json()
    assert text["prompt"] == "Hello world"


def test_vllm_extra_fields_are_accepted(client):
    response = client.completions.create(
        model=MODEL,
        prompt="Hi",
        max_tokens=10,
        extra_body={
            "ignore_eos": True,
            "min_tokens": 10,
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "stop_token_ids": [0],
        },
        presence_penalty=0.5,
        frequency_penalty=0.5,
        top_p=0.9,
    )
    assert response.usage.completion_tokens == 10


def test_batch_of_prompts(client):
    response = client.completions.create(
        model=MODEL, prompt=["Red", "Green", "Blue"], max_tokens=3, temperature=0, n=2
    )
    assert sorted(c.index for c in response.choices) == list(range(6))


def test_streamed_text_with_stop_string_matches_non_streamed(client):
    kwargs = dict(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0.0, stop=[", 7"])
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert not full.endswith(",")
