"""EAGLE-3 speculative decoding is lossless and drafts what the head computes.

Heads are written in the layout the EAGLE authors publish (``tiny_models.build_eagle3_head``:
``midlayer.*``, ``fc`` over three target layers, an own LM head over a draft vocabulary with
``d2t``). On a random target with a random sharp head, every draft the engine proposed is
checked against a float64 forward built from transformers' Llama modules: the residual
stream entering the target layers the head names (transformers' ``hidden_states[i]``),
``fc``, the layer attending over ``[input_layernorm(embedding), hidden_norm(feature)]`` with
the feature as residual, the head's norm and LM head, ``d2t``, and each further draft fed
the previous output before the norm. On the cycling model a head that passes its feature
through predicts the token after next: acceptance near 100 % at one draft a step shows
tokens, features and the draft vocabulary are paired right. Both give the plain engine's
output token for token."""

from __future__ import annotations

import pytest
import torch
from test_spec_decode import CYCLES, _acceptance, _compare, _cycling_workload, _summary
from test_spec_decode_eagle import COPYING_ENGINES, randomized_workload, record_drafts
from tiny_models import (
    build_eagle3_head,
    build_successor_eagle3_head,
    build_successor_model,
    build_tiny_model,
)

from inference import LLM, SamplingParams

AUX = [1, 3, 4]  # of the random target's 6 layers


def _eagle3(folder: str, k: int = 3, **extra) -> dict:
    return {"method": "eagle3", "model": folder, "num_speculative_tokens": k, **extra}


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    target = tmp_path_factory.mktemp("llama-eagle3")
    build_tiny_model(target, "llama", qk_scale=2.0, num_hidden_layers=6)
    head = tmp_path_factory.mktemp("llama-eagle3-head")
    tensors = build_eagle3_head(head, target, seed=5, qk_scale=3.0, aux_layers=AUX)
    return str(target), str(head), tensors


@pytest.fixture(scope="module")
def cycling(tmp_path_factory):
    path = tmp_path_factory.mktemp("successor-eagle3")
    tokenizer, model = build_successor_model(path, CYCLES)
    head = tmp_path_factory.mktemp("successor-eagle3-head")
    build_successor_eagle3_head(head, path, model, CYCLES)
    return str(path), tokenizer, str(head)


@pytest.mark.parametrize("engine", COPYING_ENGINES)
def test_eagle3_greedy_output_is_unchanged_on_a_copying_model(cycling, engine):
    folder, tokenizer, head = cycling
    prompts, params = _cycling_workload(tokenizer)
    spec = _compare(folder, prompts, params, speculative=_eagle3(head, 1), **engine)
    assert _acceptance(spec) > 0.85
    if "num_kv_blocks" in engine:
        assert spec.engine.scheduler.num_preemptions > 0


class _Reference:
    """The target's layer states and the head's drafts in float64 transformers modules."""

    def __init__(self, target: str, tensors: dict[str, torch.Tensor]) -> None:
        import transformers
        from transformers.models.llama import modeling_llama as llama

        self.target = transformers.LlamaForCausalLM.from_pretrained(target).double().eval()
        config = transformers.LlamaConfig.from_pretrained(target)
        hidden = config.hidden_size
        attn = llama.LlamaAttention(config, layer_idx=0).double().eval()
        for name in ("q_proj", "k_proj", "v_proj"):  # 2H wide: [embedding, feature]
            out_features = getattr(attn, name).out_features
            setattr(attn, name, torch.nn.Linear(2 * hidden, out_features, bias=False).double())
        self.attn, self.mlp = attn, llama.LlamaMLP(config).double().eval()
        self.rotary = llama.LlamaRotaryEmbedding(config)
        state = {k.removeprefix("midlayer."): v.double() for k, v in tensors.items()}
        self.attn.load_state_dict({k.removeprefix("self_attn."): v for k, v in state.items()
                                   if k.startswith("self_attn.")})  # fmt: skip
        self.mlp.load_state_dict({k.removeprefix("mlp."): v for k, v in state.items()
                                  if k.startswith("mlp.")})  # fmt: skip
        self.eps = config.rms_norm_eps
        self.w = state

    def _norm(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def _layer(self, embedded, features):
        """The head's outputs before its final norm, over positions 0..T-1 (causal)."""
        w = self.w
        residual = features
        x = torch.cat([self._norm(embedded, w["input_layernorm.weight"]),
                       self._norm(features, w["hidden_norm.weight"])], dim=-1)[None]
        n = x.shape[1]
        positions = torch.arange(n)[None]
        cos, sin = self.rotary(x, positions)
        mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        attended, _ = self.attn(x, (cos.double(), sin.double()), mask)
        h = attended[0] + residual
        return self.mlp(self._norm(h, w["post_attention_layernorm.weight"])) + h

    def _draft(self, out) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self._norm(out, self.w["norm.weight"]) @ self.w["lm_head.weight"].T
        targets = torch.arange(len(logits)) + self.w["d2t"].long()
        return logits, targets

    @torch.no_grad()
    def check(self, tokens: list[int], drafts: list[int]) -> None:
        """Each draft is (within fp32 noise) the argmax of the head's logits, mapped to a
        target id, teacher-forced on the drafts before it."""
        ids = torch.tensor([tokens])
        states = self.target.model(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i][0] for i in AUX], dim=-1)  # entering layers AUX
        embed = self.target.model.embed_tokens
        features = aux[:-1] @ self.w["fc.weight"].T
        embedded = embed(ids[0, 1:])
        for j, draft in enumerate(drafts):
            out = self._layer(embedded, features)[-1]
            logits, targets = self._draft(out)
            (where,) = torch.nonzero(targets == draft, as_tuple=True)
            assert len(where) == 1, (draft, "not in the draft vocabulary")
            assert logits[where[0]] >= logits.max() - 1e-3, (tokens, drafts, j)
            embedded = torch.cat([embedded, embed(torch.tensor([draft]))])
            features = torch.cat([features, out[None]])


def test_eagle3_drafts_are_the_heads_computed_from_the_targets_layers(random_pair):
    """The target states the runner keeps, the head's paged KV and its draft vocabulary
    must match a from-scratch forward (``record_drafts``' randomized workload)."""
    target, head, tensors = random_pair

    def check(engine):
        assert engine.runner.model.aux_layers == tuple(AUX)

    plain, eagle3, recorded = record_drafts(target, _eagle3(head), check)
    assert eagle3 == plain
    assert len(recorded) > 20
    assert any(d >= 33 for _, drafts in recorded for d in drafts)  # through a d2t offset
    reference = _Reference(target, tensors)
    for tokens, drafts in recorded:
        reference.check(tokens, drafts)


def test_eagle3_is_lossless_on_randomized_workloads(random_pair):
    """Stop strings, min_tokens, logprobs, shared prefixes (prefix-cache hits), preemption,
    with a random head (drafts rarely accepted)."""
    target, head, _ = random_pair
    prompts, params = randomized_workload()
    spec = _compare(target, prompts, params, require_acceptance=False,
                    speculative=_eagle3(head), num_kv_blocks=14, max_num_batched_tokens=16,
                    max_model_len=48)  # fmt: skip
    assert spec.engine.scheduler.num_preemptions > 0
    assert spec.engine.block_manager.prefix_cache_hits > 0


def test_eagle3_head_layouts_and_refusals(random_pair, tmp_path):
    """The default target layers (2, L // 2, L - 3), an own embedding, vLLM's reading of a
    model name; broken checkpoints are refused naming what is supported."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from inference.spec_decode.config import parse_speculative_config

    target, _, _ = random_pair
    settings = {"max_model_len": 32, "block_size": 4, "num_kv_blocks": 40}
    prompt = [[5, 6, 7, 8]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = _summary(LLM(target, **settings).generate(prompt, params, use_tqdm=False))
    default = tmp_path / "default"
    build_eagle3_head(default, target, embed_copy=True)
    llm = LLM(target, speculative_config=_eagle3(str(default)), **settings)
    assert _summary(llm.generate(prompt, params, use_tqdm=False)) == want
    assert llm.engine.runner.model.aux_layers == (2, 3, 3)
    assert llm.engine.spec_decoder.draft.head.embed_tokens is not None
    named = tmp_path / "org-EAGLE3-llama"
    build_eagle3_head(named, target)
    assert parse_speculative_config({"model": str(named), "num_speculative_tokens": 2}).method == "eagle3"

    def broken(name: str, change, config_change=None) -> str:
        folder = tmp_path / name
        tensors = build_eagle3_head(folder, target)
        change(tensors)
        save_file(tensors, str(folder / "model.safetensors"))
        if config_change:
            config = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**config, **config_change}))
        return str(folder)

    cases = [
        ("no-fc", lambda t: t.pop("fc.weight"), None, r"missing weights \['fc.weight'\]"),
        ("no-d2t", lambda t: t.pop("d2t"), None, "no d2t for a draft vocabulary"),
        ("bad-d2t", lambda t: t.update({"d2t": t["d2t"] + 10_000}), None,
         "outside the target's vocabulary"),
        ("extra", lambda t: t.update({"layers.0.mlp.up_proj.weight": torch.ones(2)}), None,
         "unexpected weights"),
        ("narrow-q", lambda t: t.update({"midlayer.self_attn.q_proj.weight":
                                         t["midlayer.self_attn.q_proj.weight"][:, :64]
                                         .contiguous()}), None,
         r"q_proj.weight has shape \(64, 64\), expected \(64, 128\)"),
        ("arch", lambda t: None, {"architectures": ["LlamaForCausalLM"]},
         "architecture .* is not supported"),
        ("layers", lambda t: None, {"eagle_config": {"eagle_aux_hidden_state_layer_ids":
                                                     [1, 2, 9]}}, "three ids, each in 1..5"),
    ]  # fmt: skip
    for name, change, config_change, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(target, speculative_config=_eagle3(broken(name, change, config_change)),
                **settings)
    eagle1 = Path(broken("as-eagle1", lambda t: None))
    with pytest.raises(ValueError, match="EAGLE-3 heads load with method 'eagle3'"):
        LLM(target, speculative_config={"method": "eagle", "model": str(eagle1),
                                       "num_speculative_tokens": 2}, **settings)


def test_a_live_raise_past_the_heads_target_states_is_refused(random_pair):
    """The runner keeps the target's layer states in a buffer sized for the start-up step:
    a live change to larger steps is refused (409), naming it, and changes nothing."""
    from inference.reconfigure import ReconfigureError, live_settings

    target, head, _ = random_pair
    llm = LLM(target, speculative_config=_eagle3(head), max_model_len=64, block_size=4,
              num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=8)  # fmt: skip
    engine = llm.engine
    before = live_settings(engine)
    with pytest.raises(ReconfigureError) as error:
        engine.reconfigure({"max_num_batched_tokens": 64})
    assert error.value.status == 409 and "EAGLE-3" in str(error.value)
    assert live_settings(engine) == before
    engine.reconfigure({"max_num_batched_tokens": 16})  # smaller steps fit
    assert engine.scheduler.max_num_batched_tokens == 16
