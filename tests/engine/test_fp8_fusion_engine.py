"""FP8 activation quantization fused into the producing ops, end to end on CPU: an FP8 model
generates the same greedy tokens and logprobs whether each projection's input is quantized
by the norm / SiLU-and-mul that writes it or by the projection itself, the bf16 residual
stream untouched either way; and the model takes the fused ops exactly where
``kernels.wants_fp8_input`` says so.

Two runs: the torch references (the rule is forced on: on CPU without Triton it says no,
and the math is the same, so the results are bit for bit the same), and the Triton kernels
under the interpreter with an FP8 table that sends the tiny model's decode steps to the
``fmaq`` kind (the real rule decides; fused and unfused compute the same float32 values)."""

from __future__ import annotations

import pytest
from fp8_checkpoints import ENGINE
from tiny_models import build_tiny_model

import pagoda_kernels as kernels
from inference import LLM, SamplingParams

PROMPTS = [[(5 * i + 7 * j) % 250 + 3 for i in range(n)] for j, n in enumerate((12, 5, 20))]
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
FUSED_OPS = ("rms_norm_fp8", "fused_add_rms_norm_fp8", "silu_and_mul_fp8")
RULE = kernels.wants_fp8_input


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2-fp8-fusion")
    build_tiny_model(folder, "qwen2", qk_scale=2.0)  # qkv bias; sharp attention
    return folder


def generate(folder, prompts=PROMPTS, params=GREEDY,
             **kwargs) -> list[tuple[list[int], list[dict[int, float]]]]:  # fmt: skip
    with LLM(str(folder), quantization="fp8", **(ENGINE | kwargs)) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids),
         [{t: lp.logprob for t, lp in entry.items()} for entry in o.outputs[0].logprobs])
        for o in outs
    ]  # fmt: skip


def record(monkeypatch, rule=None) -> tuple[list[bool], list[str]]:
    """Spy on the rule's answers and the fused ops' calls (``rule`` replaces the rule)."""
    answers: list[bool] = []
    calls: list[str] = []
    decide = rule or RULE

    def wants(*args, **kwargs):  # type: ignore[no-untyped-def]
        answers.append(bool(decide(*args, **kwargs)))
        return answers[-1]

    monkeypatch.setattr(kernels, "wants_fp8_input", wants)
    for name in FUSED_OPS:
        original = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _n=name, _f=original: (
            calls.append(_n), _f(*a))[1])  # fmt: skip
    return answers, calls


def test_fused_references_match_unfused_bit_for_bit(model, monkeypatch) -> None:
    answers, calls = record(monkeypatch)
    unfused = generate(model)
    assert answers and not any(answers) and not calls  # CPU references: never asked for
    monkeypatch.undo()
    answers, calls = record(monkeypatch, rule=lambda *args, **kwargs: True)
    fused = generate(model)
    assert calls.count("rms_norm_fp8") > 0 and calls.count("silu_and_mul_fp8") > 0
    assert len(calls) == len(answers)  # each yes: one fused op, in place of the unfused
    assert fused == unfused


def triton_with_fmaq_table(monkeypatch) -> None:
    """Triton kernels (TRITON_INTERPRET=1 is set for CPU runs); the tiny model's four
    projections at M <= 2 in the fmaq kind: qkv [128, 64], gate_up [256, 64], o and down
    [64, 128]."""
    from pagoda_kernels import _gemv_table
    from pagoda_kernels._gemv_table import GemvConfig

    monkeypatch.setenv("PAGODA_DISABLE_TRITON", "0")
    fmaq = [(2, GemvConfig("fmaq", 4, 32))]
    table = {(128, 64): fmaq, (256, 64): fmaq, (64, 128): fmaq}
    monkeypatch.setattr(_gemv_table, "FP8_TABLE", table)


def test_triton_kernels_fuse_where_the_rule_says(model, monkeypatch) -> None:
    """The interpreter runs every kernel; the tiny model's projections at M <= 2 take the
    fmaq kind (quantize in a launch of their own): there the fused ops run, elsewhere
    (prefills of more tokens: the reference on CPU) the unfused ones."""
    run = dict(prompts=PROMPTS[:2], params=SamplingParams(temperature=0, max_tokens=3,
               ignore_eos=True, logprobs=2), max_num_seqs=2)  # fmt: skip
    triton_with_fmaq_table(monkeypatch)
    answers, calls = record(monkeypatch, rule=lambda *args, **kwargs: False)
    unfused = generate(model, **run)
    assert not calls
    monkeypatch.undo()
    triton_with_fmaq_table(monkeypatch)
    answers, calls = record(monkeypatch)
    fused = generate(model, **run)
    assert any(answers) and not all(answers)
    assert len(calls) == sum(answers)  # fused exactly where predicted
    for (tokens, logprobs), (tokens_ref, logprobs_ref) in zip(fused, unfused, strict=True):
        assert tokens == tokens_ref
        for entry, entry_ref in zip(logprobs, logprobs_ref, strict=True):
            assert entry.keys() == entry_ref.keys()
            assert all(abs(entry[t] - entry_ref[t]) <= 1e-5 for t in entry)
