"""LoRA without a model run: which adapter folders are refused and why
(``inference.lora.peft``), device-slot LRU (``inference.lora.slots``), and the scheduler's
limit of ``max_loras`` adapters among the running sequences."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from inference.block_manager import BlockManager
from inference.config import EngineConfig
from inference.lora.peft import AdapterError, inspect_adapter, load_adapter
from inference.lora.request import LoRARequest
from inference.lora.slots import NO_SLOT, LoRASlotTable
from inference.models.config import ModelConfig
from inference.sampling_params import SamplingParams
from inference.scheduler import Scheduler
from inference.sequence import Sequence

CFG = ModelConfig.from_dict({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 64,
})  # fmt: skip
PREFIX = "base_model.model.model.layers"


def write_adapter(folder, rank=4, tensors=None, **config):
    folder.mkdir(parents=True, exist_ok=True)
    if tensors is None:
        tensors = {f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.ones(rank, 32),
                   f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.ones(32, rank),
                   f"{PREFIX}.1.mlp.down_proj.lora_A.weight": torch.ones(rank, 48),
                   f"{PREFIX}.1.mlp.down_proj.lora_B.weight": torch.ones(32, rank)}  # fmt: skip
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    base = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": ["q_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(base | config))
    return folder


def test_a_servable_adapter_and_its_scales(tmp_path):
    info = inspect_adapter(write_adapter(tmp_path / "a"), CFG, max_rank=16)
    assert info.rank == 4 and info.scale == 2.0
    assert info.modules == ((0, "q_proj"), (1, "down_proj"))
    rs = inspect_adapter(write_adapter(tmp_path / "rs", use_rslora=True), CFG, 16)
    assert rs.scale == 8 / 4**0.5
    adapter = load_adapter(tmp_path / "a", CFG, 16)
    a, b = adapter.weights[(0, "q_proj")]
    assert a.shape == (4, 32) and torch.equal(b, torch.full((32, 4), 2.0))  # scale folded in


@pytest.mark.parametrize(("setup", "message"), [
    (dict(use_dora=True), "DoRA"),
    (dict(rank=32), "rank 32 exceeds --max-lora-rank 16"),
    (dict(target_modules=["q_proj", "lm_head"]), "lm_head are not supported"),
    (dict(modules_to_save=["embed_tokens"]), "modules_to_save"),
    (dict(bias="all"), "trained biases"),
    (dict(rank_pattern={"q_proj": 8}), "per-module ranks"),
    (dict(peft_type="IA3"), "peft_type IA3"),
    (dict(tensors={f"{PREFIX}.0.mlp.fc1.lora_A.weight": torch.ones(4, 32),
                   f"{PREFIX}.0.mlp.fc1.lora_B.weight": torch.ones(48, 4)}),
     "module fc1 is not supported"),
    (dict(tensors={"base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(4, 100)}),
     "embedding or the LM head"),
    (dict(tensors={f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 33),
                   f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.ones(32, 4)}),
     r"shape \[4, 33\], expected \[4, 32\]"),
    (dict(tensors={f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 32)}),
     "not both"),
    (dict(tensors={f"{PREFIX}.9.self_attn.q_proj.lora_A.weight": torch.ones(4, 32),
                   f"{PREFIX}.9.self_attn.q_proj.lora_B.weight": torch.ones(32, 4)}),
     "has 2 layers"),
])  # fmt: skip
def test_what_is_refused_says_why(tmp_path, setup, message):
    rank = setup.pop("rank", 4)
    folder = write_adapter(tmp_path / "x", rank=rank, **setup)
    with pytest.raises(AdapterError, match=message):
        inspect_adapter(folder, CFG, max_rank=16)


def test_missing_folder_and_files(tmp_path):
    with pytest.raises(AdapterError, match="does not exist"):
        inspect_adapter(tmp_path / "nowhere", CFG, 16)
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        inspect_adapter(tmp_path / "empty", CFG, 16)
    folder = write_adapter(tmp_path / "bin")
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    with pytest.raises(AdapterError, match="convert it to safetensors"):
        inspect_adapter(folder, CFG, 16)


def test_lora_settings_are_checked():
    with pytest.raises(ValueError, match="max_loras must be >= 1"):
        EngineConfig(model="m", max_loras=0)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(model="m", max_loras=4, max_cpu_loras=2)
    assert EngineConfig(model="m", max_loras=3).cpu_lora_capacity == 3
    with pytest.raises(ValueError, match="lora_int_id must be an int >= 1"):
        LoRARequest("a", 0, "/p")


def lora(i: int) -> LoRARequest:
    return LoRARequest(f"a{i}", i, f"/adapters/{i}")


def test_slots_are_reused_least_recently_used_first():
    table = LoRASlotTable(2)
    slots, loads = table.assign([lora(1), None, lora(2), lora(1)])
    assert slots == [0, NO_SLOT, 1, 0] and loads == [(0, lora(1)), (1, lora(2))]
    assert table.assign([lora(2)]) == ([1], [])  # resident: no load
    slots, loads = table.assign([lora(3), lora(2)])  # adapter 1 is the least recent
    assert slots == [0, 1] and loads == [(0, lora(3))]
    with pytest.raises(ValueError, match="max_loras is 2"):
        table.assign([lora(1), lora(2), lora(3)])
    table.forget(lora(3))
    assert table.assign([lora(4)])[1] == [(0, lora(4))]


def test_scheduler_runs_at_most_max_loras_adapters_and_lets_others_pass():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64,
                          max_loras=2)  # fmt: skip
    adapters = [lora(1), lora(2), lora(3), None, lora(1)]
    for i, adapter in enumerate(adapters):
        scheduler.add(Sequence(i, str(i), 0, [1, 2, 3], SamplingParams(max_tokens=4),
                               lora_request=adapter))  # fmt: skip
    batch = scheduler.schedule()
    assert [s.seq_id for s in batch.seqs] == [0, 1, 3, 4]  # adapter 3 waits, the rest pass
    assert [s.seq_id for s in scheduler.waiting] == [2]
    scheduler.finish(batch.seqs[1])  # adapter 2's only sequence ends: room for adapter 3
    assert [s.seq_id for s in scheduler.schedule().seqs][-1] == 2
