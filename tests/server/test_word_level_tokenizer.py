"""A word-level tokenizer that maps most text to no tokens at all: the engine must still
warm up (it warms up with token ids, not text), and a prompt that tokenizes to nothing is
the client's error (a ValueError offline, a 400 naming ``prompt`` from the API), never a
crash inside the model runner."""

from __future__ import annotations

import httpx
import pytest
from server_harness import ServerThread
from tiny_models import build_tiny_model

from inference.config import EngineConfig
from inference.engine_core import _warm_up
from inference.llm import LLM
from inference.llm_engine import LLMEngine
from inference.sampling_params import SamplingParams

ENGINE_ARGS = dict(device="cpu", max_model_len=64, num_kv_blocks=16, max_num_seqs=4)


def save_digit_tokenizer(folder) -> None:
    """Words are numbers 0..99; everything else is normalised away (a toy arithmetic
    model's tokenizer): "Hello, warm-up." encodes to no tokens."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2} | {str(i): 3 + i for i in range(100)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab))
    tokenizer.normalizer = normalizers.Replace(Regex(r"[^0-9\s]"), " ")
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(folder)
    assert fast("Hello, warm-up.").input_ids == []


@pytest.fixture(scope="module")
def digit_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("digit_llama")
    build_tiny_model(folder, "llama")
    for stale in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "vocab.json", "merges.txt"):  # fmt: skip
        (folder / stale).unlink(missing_ok=True)
    save_digit_tokenizer(folder)
    return str(folder)


def test_engine_warms_up_whatever_the_tokenizer(digit_model):
    engine = LLMEngine(EngineConfig.from_kwargs(digit_model, **ENGINE_ARGS))
    _warm_up(engine)
    assert not engine.has_unfinished_requests()


def test_prompt_of_no_tokens_is_a_value_error_offline(digit_model):
    llm = LLM(digit_model, **ENGINE_ARGS)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with pytest.raises(ValueError, match="prompt.*no tokens"):
        llm.generate("Hello, world", params, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 1.*no tokens"):
        llm.generate(["1 2 3", "no digits here"], params, use_tqdm=False)
    assert not llm.engine.requests  # all or nothing
    [output] = llm.generate("1 2 3", params, use_tqdm=False)
    assert output.prompt_token_ids == [4, 5, 6] and len(output.outputs[0].token_ids) == 3


def test_server_starts_and_answers_400_for_a_prompt_of_no_tokens(digit_model):
    server = ServerThread(digit_model, served_model_names=["digits"], **ENGINE_ARGS).start()
    try:
        url = f"{server.base_url}/v1/completions"
        response = httpx.post(url, json={"model": "digits", "prompt": "Hello"}, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "prompt" and error["type"] == "invalid_request_error"
        assert "empty" in error["message"]
        response = httpx.post(
            url, json={"model": "digits", "prompt": "7 8", "max_tokens": 2, "ignore_eos": True},
            timeout=60,
        )  # fmt: skip
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 2
    finally:
        server.stop()
