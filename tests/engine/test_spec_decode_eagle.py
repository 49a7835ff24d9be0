"""EAGLE speculative decoding is lossless and drafts what the head computes.

Heads are written in the layout the EAGLE authors publish (``tiny_models.build_eagle_head``).
On the cycling model a head whose ``fc`` passes the next token's embedding through predicts
every successor: acceptance near 100 % shows tokens and positions are paired right (token
p + 1 beside feature p) through chunked prefill, preemption and async scheduling. On a
random target with a random sharp head, every draft the engine proposed is checked against
transformers: the target's features from its own forward over the known tokens, the head
as a transformers Llama layer (layer 0 without its input norm) fed ``fc(embed, feature)``
and then its own outputs, logits from the target's LM head. Both give the plain engine's
output token for token (logprobs within fp32 tolerance), with stop strings, min_tokens,
logprobs, prefix-cache hits, randomized prompt lengths and arrival steps."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_spec_decode import (
    CYCLES,
    _acceptance,
    _check_engine_clean,
    _compare,
    _cycling_workload,
    _summary,
    _two_sample_p_value,
)
from tiny_models import build_eagle_head, build_successor_model, build_tiny_model

from inference import LLM, SamplingParams


@pytest.fixture(scope="module")
def cycling(tmp_path_factory):
    path = tmp_path_factory.mktemp("successor-eagle")
    tokenizer, _ = build_successor_model(path, CYCLES)
    head = tmp_path_factory.mktemp("successor-eagle-head")
    # fc = [I, 0]: the head's output is the next token's embedding (its layer passes it
    # through), whose LM-head row is that token's successor: the target's next pick.
    build_eagle_head(head, path, fc=torch.cat([torch.eye(64), torch.zeros(64, 64)], dim=1),
                     fc_bias=False, zero_outputs=True)
    return str(path), tokenizer, str(head)


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    target = tmp_path_factory.mktemp("llama-eagle")
    build_tiny_model(target, "llama", qk_scale=2.0)
    head = tmp_path_factory.mktemp("llama-eagle-head")
    tensors = build_eagle_head(head, target, seed=5, qk_scale=3.0)
    return str(target), str(head), tensors


def _eagle(folder: str, k: int = 3, **extra) -> dict:
    return {"method": "eagle", "model": folder, "num_speculative_tokens": k, **extra}


# Engine settings the copying-model tests run under (EAGLE-3's too).
COPYING_ENGINES = [
    {"async_scheduling": True},
    {"async_scheduling": False, "enable_prefix_caching": False},
    {"max_num_batched_tokens": 8, "max_num_seqs": 4},  # chunked prefill; budget trims drafts
    {"num_kv_blocks": 14, "max_num_batched_tokens": 16, "max_model_len": 48},  # preemption
]


@pytest.mark.parametrize("engine", COPYING_ENGINES)
def test_eagle_greedy_output_is_unchanged_on_a_copying_model(cycling, engine):
    folder, tokenizer, head = cycling
    prompts, params = _cycling_workload(tokenizer)
    spec = _compare(folder, prompts, params, speculative=_eagle(head, 4), **engine)
    assert _acceptance(spec) > 0.85
    if "num_kv_blocks" in engine:
        assert spec.engine.scheduler.num_preemptions > 0


class _Reference:
    """The target's features and the head's drafts in float64 transformers modules."""

    def __init__(self, target: str, tensors: dict[str, torch.Tensor]) -> None:
        import transformers

        self.target = transformers.LlamaForCausalLM.from_pretrained(target).double().eval()
        config = transformers.LlamaConfig.from_pretrained(target, num_hidden_layers=1)
        self.head = transformers.LlamaModel(config).double().eval()
        self.head.layers[0].input_layernorm = torch.nn.Identity()
        self.head.norm = torch.nn.Identity()
        state = {k: v for k, v in tensors.items() if k.startswith("layers.")}
        missing, unexpected = self.head.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) == {"embed_tokens.weight"}, missing
        self.fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size).double()
        self.fc.load_state_dict({"weight": tensors["fc.weight"], "bias": tensors["fc.bias"]})

    @torch.no_grad()
    def check(self, tokens: list[int], drafts: list[int]) -> None:
        """Each draft is the argmax (within fp32 noise) of the head's logits, teacher-forced
        on the drafts before it."""
        ids = torch.tensor([tokens])
        features = self.target.model(ids).last_hidden_state[0]  # after the final norm
        embed = self.target.model.embed_tokens
        inputs = self.fc(torch.cat([embed(ids[0, 1:]), features[:-1]], dim=-1))
        for j, draft in enumerate(drafts):
            out = self.head(inputs_embeds=inputs[None]).last_hidden_state[0, -1]
            logits = self.target.lm_head(out)
            assert logits[draft] >= logits.max() - 1e-3, (tokens, drafts, j)
            step = self.fc(torch.cat([embed(torch.tensor(draft)), out])[None])
            inputs = torch.cat([inputs, step])


def record_drafts(target: str, speculative: dict, check_engine=None):
    """Randomized prompt lengths and arrival steps, chunked prefill, async scheduling: the
    plain engine's outputs, the speculative one's, and every (known tokens, drafts) the
    proposer made. ``check_engine``: called with the speculative engine once built."""
    rng = random.Random(3)
    requests = [([rng.randrange(3, 300) for _ in range(rng.randrange(2, 30))],
                 SamplingParams(temperature=0, max_tokens=rng.randrange(4, 16),
                                ignore_eos=True), rng.randrange(0, 12))
                for _ in range(7)]  # fmt: skip
    settings = {"max_model_len": 64, "block_size": 4, "seed": 0, "num_kv_blocks": 200,
                "max_num_batched_tokens": 16}  # fmt: skip
    results = []
    recorded: list[tuple[list[int], list[int]]] = []
    for config in (None, speculative):
        engine = LLM(target, speculative_config=config, **settings).engine
        if config is not None:
            if check_engine is not None:
                check_engine(engine)
            proposer = engine.spec_decoder.draft
            propose = proposer.propose

            def recording(seqs, propose=propose):
                propose(seqs)
                recorded.extend((list(s.token_ids), list(s.draft_token_ids)) for s in seqs
                                if s.draft_token_ids)  # fmt: skip

            proposer.propose = recording
        outputs, step = {}, 0
        while step < 12 or engine.has_unfinished_requests():
            for i, (prompt, params, arrival) in enumerate(requests):
                if arrival == step:
                    engine.add_request(str(i), prompt, params)
            for output in engine.step():
                if output.finished:
                    outputs[output.request_id] = output.outputs[0].token_ids
            step += 1
        results.append(outputs)
    return results[0], results[1], recorded


def test_eagle_drafts_are_the_heads_computed_from_the_targets_features(random_pair):
    """The head's paged KV and the features it is fed must match a from-scratch forward
    (``record_drafts``' workload)."""
    target, head, tensors = random_pair
    plain, eagle, recorded = record_drafts(target, _eagle(head))
    assert eagle == plain
    assert len(recorded) > 20
    reference = _Reference(target, tensors)
    for tokens, drafts in recorded:
        reference.check(tokens, drafts)


def randomized_workload():
    """Stop strings, min_tokens, logprobs, half the prompts sharing a prefix."""
    rng = random.Random(4)
    prefix = [rng.randrange(3, 300) for _ in range(9)]
    prompts, params = [], []
    for i in range(8):
        tail = [rng.randrange(3, 300) for _ in range(rng.randrange(1, 14))]
        prompts.append(prefix + tail if i % 2 else tail)
        params.append(SamplingParams(
            temperature=0, max_tokens=rng.randrange(5, 20), ignore_eos=rng.random() < 0.5,
            logprobs=rng.choice([None, 1, 3]), min_tokens=rng.choice([0, 0, 4]),
            stop=[" the"] if i % 3 == 0 else None,
        ))
    return prompts, params


def test_eagle_is_lossless_on_randomized_workloads(random_pair, cycling):
    """Stop strings, min_tokens, logprobs, shared prefixes (prefix-cache hits), preemption;
    a random head (drafts rarely accepted) and the cycling head (mostly accepted)."""
    target, head, _ = random_pair
    prompts, params = randomized_workload()
    spec = _compare(target, prompts, params, require_acceptance=False, speculative=_eagle(head),
                    num_kv_blocks=14, max_num_batched_tokens=16, max_model_len=48)
    assert spec.engine.scheduler.num_preemptions > 0
    assert spec.engine.block_manager.prefix_cache_hits > 0
    folder, tokenizer, cycling_head = cycling
    cycle_prompts = [[10, 11, 12, 13, 14, 10, 11] * 2, [10, 11, 12, 13, 14, 10, 11, 20, 21],
                     [20, 21, 22, 1, 20, 21]]  # shared first block: a prefix-cache hit
    cycle_params = [SamplingParams(temperature=0, max_tokens=20, logprobs=1, min_tokens=4,
                                   stop=[tokenizer.decode([13])] if i == 1 else None)
                    for i in range(3)]  # fmt: skip
    spec = _compare(folder, cycle_prompts, cycle_params, speculative=_eagle(cycling_head))
    assert _acceptance(spec) > 0.8


def test_eagle_sampling_keeps_the_distribution(cycling):
    """Temperature 1: the head's drafts (the successor) are accepted often and rejected
    often enough; positions 1-3 are distributed as without speculation."""
    folder, _, head = cycling
    prompt = [10, 11, 12, 13, 14, 10, 11]
    num = 300
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, n=num)
    settings = {"max_model_len": 32, "block_size": 8, "num_kv_blocks": 2 * num, "seed": 1,
                "max_num_seqs": num}
    plain = LLM(folder, **settings).generate([prompt], params, use_tqdm=False)
    spec_llm = LLM(folder, **settings, speculative_config=_eagle(head, 3,
                                                                disable_by_batch_size=1024))
    spec = spec_llm.generate([prompt], params, use_tqdm=False)
    _check_engine_clean(spec_llm, spec)
    counters = spec_llm.engine.spec_decoder.counters
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    for position in range(1, 4):
        a = np.array([c.token_ids[position] for c in plain[0].outputs])
        b = np.array([c.token_ids[position] for c in spec[0].outputs])
        assert _two_sample_p_value(a, b) > 1e-4, position


def test_eagle_aborts_free_the_heads_state_with_the_blocks(cycling):
    folder, _, head = cycling
    llm = LLM(folder, max_model_len=160, block_size=4, num_kv_blocks=100,
              speculative_config=_eagle(head))
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    engine.add_request("a", [10, 11, 12, 13, 14, 10, 11], params)
    engine.add_request("b", [20, 21, 22], params)
    for _ in range(4):
        engine.step()
    assert engine.spec_decoder.counters.num_drafts > 0
    engine.abort_request(["a", "b"])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.num_total_blocks
    engine.step()
    engine.spec_decoder.draft.propose([])  # a catch-up forgets the finished sequences
    assert len(engine.spec_decoder.draft._states) == 0


def test_eagle_head_layouts(random_pair, tmp_path):
    """The published layout loads from safetensors or pytorch_model.bin (fc.bias and the
    embedding copy optional); other layouts are refused naming what is supported."""
    target, _, _ = random_pair
    settings = {"max_model_len": 32, "block_size": 4, "num_kv_blocks": 40}
    prompt = [[5, 6, 7, 8]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = _summary(LLM(target, **settings).generate(prompt, params, use_tqdm=False))
    bin_head = tmp_path / "bin"
    build_eagle_head(bin_head, target, bin_format=True, fc_bias=False, embed_copy=False,
                     num_layers=2)
    llm = LLM(target, speculative_config=_eagle(str(bin_head)), **settings)
    assert _summary(llm.generate(prompt, params, use_tqdm=False)) == want
    assert llm.engine.spec_decoder.draft.head.fc_bias is None

    from safetensors.torch import save_file

    def broken(name: str, change) -> str:
        folder = tmp_path / name
        tensors = build_eagle_head(folder, target)
        change(tensors)
        save_file(tensors, str(folder / "model.safetensors"))
        return str(folder)

    cases = [
        ("no-fc", lambda t: t.pop("fc.weight"), "no fc.weight"),
        ("own-lm-head", lambda t: t.update({"lm_head.weight": t["embed_tokens.weight"].clone()}),
         "EAGLE-3"),
        ("d2t", lambda t: t.update({"d2t": torch.zeros(4, dtype=torch.int64)}), "EAGLE-3"),
        ("hass", lambda t: t.update({"embedding_layernorm.weight": torch.ones(64)}),
         "unexpected EAGLE head weight 'embedding_layernorm.weight'"),
        ("no-down", lambda t: t.pop("layers.0.mlp.down_proj.weight"), "missing weights"),
        ("no-k", lambda t: t.pop("layers.0.self_attn.k_proj.weight"), "missing weights"),
        ("narrow-fc", lambda t: t.update({"fc.weight": t["fc.weight"][:, :64].contiguous()}),
         r"fc.weight has shape \(64, 64\), expected \(64, 128\)"),
    ]
    for name, change, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(target, speculative_config=_eagle(broken(name, change)), **settings)
    wide = tmp_path / "wide"
    build_tiny_model(wide, "llama", hidden_size=128)
    wide_head = tmp_path / "wide-head"
    build_eagle_head(wide_head, wide)
    with pytest.raises(ValueError, match="hidden_size 128 differs from the target's 64"):
        LLM(target, speculative_config=_eagle(str(wide_head)), **settings)


def test_eagle3_and_foreign_head_configs_are_refused(random_pair, tmp_path):
    import json
    from pathlib import Path

    from inference.models.config import ModelConfig
    from inference.models.eagle import eagle_head_config

    target, _, _ = random_pair
    raw = json.loads((Path(target) / "config.json").read_text())
    target_config = ModelConfig.from_dict(raw)
    for name, change, message in [
        ("eagle3", {"draft_vocab_size": 32}, "an EAGLE-3 or speculators config"),
        ("qwen", {"architectures": ["Qwen2ForCausalLM"]}, "architecture .* is not supported"),
        ("vocab", {"vocab_size": 500}, "vocab_size 500 differs from the target's"),
    ]:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**raw, **change}))
        with pytest.raises(ValueError, match=message):
            eagle_head_config(folder, target_config)
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "config.json").write_text(
        json.dumps({**raw, "architectures": ["EagleLlamaForCausalLM"], "num_hidden_layers": 1}))
    assert eagle_head_config(tmp_path / "ok", target_config).num_layers == 1
