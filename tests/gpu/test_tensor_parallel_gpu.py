"""Tensor parallelism over two GPUs (NCCL): fp32 greedy tokens equal the CPU reference with
CUDA graphs and eagerly, and a killed worker (possibly inside an NCCL collective) fails
the engine within seconds. The CPU (gloo) versions run in CI: tests/engine."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from tiny_models import build_tiny_model

from inference import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (multi-GPU H200 suite)"
    ),
]

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module", params=[("qwen2", 2), ("llama", 1)])
def setup(request, tmp_path_factory):
    arch, kv_heads = request.param
    folder = tmp_path_factory.mktemp(arch)
    build_tiny_model(folder, arch, head_dim=64, hidden_size=256, num_attention_heads=4,
                     num_key_value_heads=kv_heads, vocab_size=321)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (3, 17, 64, 200, 1)]
    with LLM(str(folder), device="cpu", max_model_len=512) as cpu:
        expected = [o.outputs[0].token_ids for o in cpu.generate(prompts, GREEDY, use_tqdm=False)]
    return folder, prompts, expected


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_tp2_fp32_equals_cpu(setup, enforce_eager):
    folder, prompts, expected = setup
    with LLM(str(folder), device="cuda", dtype="float32", max_model_len=512,
             tensor_parallel_size=2, enforce_eager=enforce_eager,
             num_kv_blocks=2048) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected


def test_tp2_killed_worker_fails_fast(setup):
    folder, _, _ = setup
    llm = LLM(str(folder), device="cuda", max_model_len=512, tensor_parallel_size=2,
              num_kv_blocks=2048)
    processes = list(llm.engine.runner.processes)

    def kill() -> None:
        while llm.engine.output_processor.generation_tokens_total < 8:
            time.sleep(0.005)
        os.kill(processes[1].pid, signal.SIGKILL)

    killer = threading.Thread(target=kill)
    killer.start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1"):
        llm.generate([[5, 6, 7]] * 64, SamplingParams(temperature=0, max_tokens=400,
                                                      ignore_eos=True), use_tqdm=False)
    killer.join()
    assert time.monotonic() - start < 60
    assert all(not p.is_alive() for p in processes)
    llm.shutdown()
