"""The server makes the text (``inference/text_output.py``): what a client gets through the
engine process is what the engine gives when it makes its own text, token for token and
character for character.

Both sides run here in one process: one engine makes its own text (the offline ``LLM``'s
path); another leaves it to the server as the engine process does (``leave_text_to_server``),
its steps' ``OutputRows`` go through ``EngineCore._rows``, a pickle round trip and
``TextOutputs``, and the stop strings the server finds go back as ``StopSequences`` after a
lag of 0 or 2 steps (the engine generates on meanwhile: those tokens must never show).
"""

from __future__ import annotations

import pickle
import random

import pytest
from tiny_models import build_successor_model, build_tiny_model

from inference.config import EngineConfig
from inference.engine_core import EngineCore
from inference.engine_messages import AddRequest, StopSequences
from inference.llm_engine import LLMEngine
from inference.outputs import OutputAccumulator, RequestOutput
from inference.sampling_params import RequestOutputKind, SamplingParams
from inference.text_output import CompletionText, TextOutputs

LONG = "STOPPING" + "x" * 32
EOS = 1
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}  # fmt: skip


@pytest.fixture(scope="module")
def successor(tmp_path_factory):
    """Greedy continuation of [3, 4, 5]: 6 "$", 7 "%", 320 LONG, 8 "&", EOS, 5 "#", 6 ..."""
    folder = tmp_path_factory.mktemp("successor-text")
    successors = {5: 6, 6: 7, 7: 320, 320: 8, 8: EOS, EOS: 5}
    build_successor_model(folder, successors, added_tokens=[LONG])
    return str(folder)


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("random-text")
    build_tiny_model(folder, "qwen2", hidden_size=64, num_attention_heads=4,
                     num_key_value_heads=2, seed=5, max_position_embeddings=256)  # fmt: skip
    return str(folder)


def _engine(folder: str, **kwargs) -> LLMEngine:
    settings = dict(device="cpu", max_model_len=128, block_size=4, num_kv_blocks=400,
                    max_num_seqs=8, seed=0)  # fmt: skip
    return LLMEngine(EngineConfig.from_kwargs(folder, **{**settings, **kwargs}))


def _in_engine(folder: str, requests: list[tuple[list[int], SamplingParams]], **kwargs):
    engine = _engine(folder, **kwargs)
    try:
        for i, (prompt, params) in enumerate(requests):
            params = params.clone()
            params.output_kind = RequestOutputKind.FINAL_ONLY
            engine.add_request(f"r{i}", prompt, params)
        done: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                done[output.request_id] = output
        return [done[f"r{i}"] for i in range(len(requests))]
    finally:
        engine.shutdown()


def _through_server(folder: str, requests, lag: int, **kwargs):
    """The engine process's path, minus the pipes (the rows still take a pickle round trip)."""
    engine = _engine(folder, **kwargs)
    core = EngineCore(EngineConfig.from_kwargs(folder), commands=None, outputs=None)
    text = TextOutputs()
    text.set_tokenizer(engine.tokenizer, engine.eos_token_ids)
    engine.leave_text_to_server()
    try:
        accumulators = {}
        for i, (prompt, params) in enumerate(requests):
            request_id = f"r{i}"
            text.add(request_id, params)
            core._handle(engine, AddRequest(request_id, prompt, params.clone(), 0.0))
            accumulators[request_id] = OutputAccumulator(request_id, None, list(prompt))
        pending: list[list] = []  # stops on their way to the engine, one list per step
        finished: set[str] = set()
        for _ in range(10_000):
            if not engine.has_unfinished_requests() and not pending:
                break
            rows = pickle.loads(pickle.dumps(core._rows(engine.step(), 1.0)[0]))
            outputs, stops = text.process(rows)
            for request_id, output in outputs.items():
                assert request_id not in finished, "output after the request finished"
                accumulators[request_id].add(output)
                if output.finished:
                    finished.add(request_id)
            pending.append(stops)
            if len(pending) > lag:
                arrived = pending.pop(0)
                if arrived:
                    core._handle(engine, StopSequences(arrived))
        assert finished == set(accumulators), "a request never finished"
        assert engine.block_manager.num_free_blocks == engine.num_total_blocks
        assert text.requests == {}
        outputs = [accumulators[f"r{i}"].output() for i in range(len(requests))]
        # The engine stopped soon after hearing: a few tokens past each stop string at most
        # (the lag's steps and the one in flight, each up to k + 1 tokens with drafts).
        per_step = 1 + (kwargs.get("speculative_config") or {}).get("num_speculative_tokens", 0)
        shown = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        num_stopped = sum(isinstance(c.stop_reason, str) for o in outputs for c in o.outputs)
        generated = engine.stats().generation_tokens_total
        assert generated <= shown + num_stopped * (lag + 2) * per_step, (generated, shown)
        return outputs, text.finished
    finally:
        engine.shutdown()


def _summary(outputs: list[RequestOutput]):
    return [
        [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs]
        for o in outputs
    ]


def _logprobs(outputs: list[RequestOutput]):
    """(token id -> (rank, decoded text)) per token, and the cumulative logprobs."""
    entries, cumulative = [], []
    for o in outputs:
        for c in o.outputs:
            entries.append([{t: (lp.rank, lp.decoded_token) for t, lp in row.items()}
                            for row in c.logprobs or []])  # fmt: skip
            cumulative.append(c.cumulative_logprob)
    return entries, cumulative


SCRIPTED = [  # stop knobs on the scripted continuation; each request also runs with n=2
    dict(stop=["STOP"]),
    dict(stop=["STOP"], include_stop_str_in_output=True),
    dict(stop=["%ST"]),
    dict(stop=["xxx&"]),
    dict(stop=["%"], min_tokens=2),
    dict(stop=["%S"], min_tokens=2),
    dict(stop=["never", "&#"], max_tokens=30),
    dict(stop=["#$%"], include_stop_str_in_output=True),
    dict(stop_token_ids=[8], include_stop_str_in_output=True),
    dict(stop=["&"], ignore_eos=False),
    dict(stop=["zz"], max_tokens=9),  # no stop string: max_tokens
]


@pytest.mark.parametrize("lag", [0, 2])
@pytest.mark.parametrize("speculative", [None, NGRAM], ids=["plain", "ngram"])
def test_scripted_stops_read_the_same_through_the_server(successor, lag, speculative):
    requests = []
    for knobs in SCRIPTED:
        knobs = {"ignore_eos": True, "max_tokens": 20, **knobs}
        requests.append(([3, 4, 5], SamplingParams(temperature=0, logprobs=1, **knobs)))
        requests.append(([3, 4, 5], SamplingParams(temperature=0, n=2, **knobs)))
    kwargs = {"speculative_config": speculative} if speculative else {}
    want = _in_engine(successor, requests, **kwargs)
    got, finished = _through_server(successor, requests, lag, **kwargs)
    assert _summary(got) == _summary(want)
    assert _logprobs(got)[0] == _logprobs(want)[0]
    assert _logprobs(got)[1] == pytest.approx(_logprobs(want)[1], abs=1e-4)
    assert sum(finished.values()) == len(requests)
    assert finished.get("length") == sum(1 for o in want if o.outputs[0].finish_reason == "length")


def test_random_workload_reads_the_same_through_the_server(random_model):
    """Sampled completions (seeded), n up to 3, logprobs and prompt logprobs, and stop
    strings cut from what the engine writes without them, at random places."""
    rng = random.Random(17)
    base = []
    for _ in range(12):
        prompt = [rng.randrange(3, 300) for _ in range(rng.randrange(1, 40))]
        base.append((prompt, dict(
            temperature=rng.choice([0.0, 0.8, 1.2]), seed=rng.randrange(1000),
            n=rng.choice([1, 1, 2, 3]), max_tokens=rng.randrange(4, 24), ignore_eos=True,
            logprobs=rng.choice([None, 0, 2]), prompt_logprobs=rng.choice([None, None, 1]),
        )))  # fmt: skip
    free = _in_engine(random_model, [(p, SamplingParams(**k)) for p, k in base])
    requests = []
    for (prompt, knobs), output in zip(base, free):
        stops = []
        for completion in output.outputs:
            text = completion.text
            if len(text) > 3 and rng.random() < 0.8:
                start = rng.randrange(1, len(text) - 1)
                stops.append(text[start : start + rng.randrange(1, 4)])
        knobs = dict(knobs, stop=stops or None,
                     include_stop_str_in_output=rng.random() < 0.3)  # fmt: skip
        requests.append((prompt, SamplingParams(**knobs)))
    want = _in_engine(random_model, requests)
    assert any(c.stop_reason for o in want for c in o.outputs), "no stop string was hit"
    for lag in (0, 2):
        got, _ = _through_server(random_model, requests, lag)
        assert _summary(got) == _summary(want)
        assert _logprobs(got)[0] == _logprobs(want)[0]
        assert _logprobs(got)[1] == pytest.approx(_logprobs(want)[1], abs=1e-4)
        for g, w in zip(got, want):
            assert (g.prompt_logprobs is None) == (w.prompt_logprobs is None)
            if w.prompt_logprobs is not None:
                assert [None if e is None else {t: lp.decoded_token for t, lp in e.items()}
                        for e in g.prompt_logprobs] == [
                    None if e is None else {t: lp.decoded_token for t, lp in e.items()}
                    for e in w.prompt_logprobs]  # fmt: skip


def test_held_back_text_is_never_cut_back(successor):
    """Delta text handed out while a completion runs is never taken back by a stop string
    found later: what may start one is held back."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(successor)
    params = SamplingParams(stop=["&#$"], ignore_eos=True)
    text = CompletionText(tokenizer, [3, 4, 5], params, frozenset())
    pieces, num_out = [], 0
    for token in [6, 7, 320, 8, 1, 5, 6, 7]:
        num_out += 1
        stop = text.add(token, num_out)
        pieces.append(text.take_new(stop is not None))
        if stop is not None:
            break
    assert stop == "&#$" and "".join(pieces) == "$%" + LONG
    assert all("&" not in piece for piece in pieces)
