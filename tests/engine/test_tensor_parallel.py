"""Tensor parallelism on CPU (gloo): two worker processes give the same tokens as one
in-process model, and a dead worker fails the engine at once without leaving processes
behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from tiny_models import build_tiny_model

from inference import LLM, SamplingParams
from inference.parallel_state import check_divisible, kv_head_range, vocab_range

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(
    n=2, temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=NEW_TOKENS, ignore_eos=True
)
ENGINE_ARGS = dict(
    device="cpu", max_model_len=256, block_size=16, max_num_batched_tokens=64,
    enable_prefix_caching=True,
)

# (arch, overrides): KV heads split (2 over 2 ranks), with qkv bias (Qwen2), and one KV
# head replicated on both ranks with q/k norm, tied embeddings and an odd vocabulary
# (padded to a multiple of the rank count).
MODELS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3-1kv-tied-oddvocab": (
        "qwen3", {"num_key_value_heads": 1, "tie_word_embeddings": True, "vocab_size": 321}
    ),
}


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 17, 2, 40)]
    # Longer than a step's token budget (64): prefilled in chunks.
    prompts.append(torch.randint(3, 300, (150,), generator=gen).tolist())
    return prompts


def _workload(llm: LLM) -> dict[str, list]:
    prompts = _prompts()
    shared = prompts[4][:48]  # three full blocks: later prompts hit the prefix cache
    out = {
        "greedy": llm.generate(prompts, GREEDY, use_tqdm=False),
        "seeded": llm.generate(prompts[:3], SEEDED, use_tqdm=False),
        "prefix": llm.generate([shared + p[:6] for p in prompts[:3]], GREEDY, use_tqdm=False),
    }
    # Prompt logprobs of a chunked prompt travel back from rank 0 with the step's result.
    scored = llm.generate(prompts[4], SamplingParams(max_tokens=1, prompt_logprobs=2),
                          use_tqdm=False)[0].prompt_logprobs  # fmt: skip
    return {
        name: [[c.token_ids for c in o.outputs] for o in outs] for name, outs in out.items()
    } | {
        "cached": [o.num_cached_tokens for o in out["prefix"]],
        "prompt_logprobs": [
            None if e is None else {t: lp.logprob for t, lp in e.items()} for e in scored
        ],
    }


@pytest.fixture(scope="module", params=list(MODELS))
def outputs_by_tp(request, tmp_path_factory):
    arch, overrides = MODELS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    build_tiny_model(folder, arch, **overrides)
    results = {}
    for tp in (1, 2):
        with LLM(str(folder), tensor_parallel_size=tp, **ENGINE_ARGS) as llm:
            results[tp] = _workload(llm)
            runner = llm.engine.runner
            results[tp]["executor"] = (type(runner).__name__, _missing_members(runner))
            if tp == 2:
                processes = llm.engine.runner.processes
    assert all(not p.is_alive() for p in processes), "workers must stop on shutdown"
    return results


def _missing_members(runner) -> list[str]:
    """The members of ``ModelExecutor`` that ``runner`` lacks (the engine calls them
    without probing)."""
    from inference.executor.interface import ModelExecutor

    members = set(ModelExecutor.__annotations__) | {
        name for name in vars(ModelExecutor) if not name.startswith("_")
    }
    assert {"launch", "load_seconds", "dead_reason", "close"} <= members
    return [name for name in sorted(members) if not hasattr(runner, name)]


def test_runner_and_executor_have_every_member_the_engine_calls(outputs_by_tp):
    """One device: a ``ModelRunner``; tensor parallel: a ``MultiprocExecutor``. Both must
    provide all of ``ModelExecutor``."""
    assert outputs_by_tp[1]["executor"] == ("ModelRunner", [])
    assert outputs_by_tp[2]["executor"] == ("MultiprocExecutor", [])


def test_greedy_tokens_match_single_rank(outputs_by_tp):
    assert outputs_by_tp[2]["greedy"] == outputs_by_tp[1]["greedy"]


def test_seeded_sampling_matches_single_rank(outputs_by_tp):
    seeded = outputs_by_tp[2]["seeded"]
    assert seeded == outputs_by_tp[1]["seeded"]
    assert all(len(o) == 2 and o[0] != o[1] for o in seeded)  # n=2, distinct seeds


def test_prefix_cache_hits_match_single_rank(outputs_by_tp):
    assert outputs_by_tp[2]["prefix"] == outputs_by_tp[1]["prefix"]
    assert outputs_by_tp[2]["cached"] == [48, 48, 48]


def test_prompt_logprobs_match_single_rank(outputs_by_tp):
    tp1, tp2 = outputs_by_tp[1]["prompt_logprobs"], outputs_by_tp[2]["prompt_logprobs"]
    assert len(tp1) == len(tp2) == 150 and tp1[0] is None and tp2[0] is None
    for one, two in zip(tp1[1:], tp2[1:], strict=True):
        assert one.keys() == two.keys() or len(one) == len(two)  # near-ties may swap
        common = one.keys() & two.keys()
        assert [one[t] for t in common] == pytest.approx([two[t] for t in common], abs=1e-4)


def test_synchronous_and_penalised_steps_match_single_rank(tmp_path):
    """Workers answer a step once the next is queued, or when the engine asks (FLUSH):
    steps the engine completes at once (async scheduling off; penalised rows) take the
    second path."""
    build_tiny_model(tmp_path, "llama")
    prompts = _prompts()[:3]
    penalised = SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3,
                               ignore_eos=True)
    runs = []
    for tp, async_scheduling in ((1, True), (2, False), (2, True)):
        with LLM(str(tmp_path), tensor_parallel_size=tp, async_scheduling=async_scheduling,
                 **ENGINE_ARGS) as llm:
            outs = llm.generate(prompts, [GREEDY, penalised, GREEDY], use_tqdm=False)
            runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[1] == runs[0] and runs[2] == runs[0]


# -- failures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-kill")
    build_tiny_model(folder, "llama")
    return folder


def test_killed_worker_fails_the_engine_fast(llama_folder):
    llm = LLM(str(llama_folder), tensor_parallel_size=2, **ENGINE_ARGS)
    engine = llm.engine
    processes = list(engine.runner.processes)
    victim = processes[1]
    killed_at: list[float] = []

    def kill_when_running() -> None:
        deadline = time.monotonic() + 60
        while engine.output_processor.generation_tokens_total < 8 and time.monotonic() < deadline:
            time.sleep(0.005)
        killed_at.append(time.monotonic())
        os.kill(victim.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_running)
    killer.start()
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    try:
        with pytest.raises(RuntimeError, match=r"rank 1 .*killed by signal SIGKILL") as err:
            llm.generate([[5, 6, 7]] * 16, params, use_tqdm=False)
        failed_at = time.monotonic()
    finally:
        killer.join()
    assert str(victim.pid) in str(err.value)
    assert failed_at - killed_at[0] < 10
    # Every worker is gone, and the engine stays failed with the same reason.
    assert all(not p.is_alive() for p in processes)
    with pytest.raises(RuntimeError, match="rank 1"):
        engine.check_health()
    with pytest.raises(RuntimeError, match="rank 1"):
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
    llm.shutdown()


def test_worker_death_between_steps_shows_in_health(llama_folder):
    llm = LLM(str(llama_folder), tensor_parallel_size=2, device="cpu", max_model_len=128)
    engine = llm.engine
    engine.check_health()  # healthy: returns None
    processes = list(engine.runner.processes)
    os.kill(processes[0].pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while engine.runner.is_alive and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(RuntimeError, match=r"rank 0 .*killed by signal SIGKILL"):
        engine.check_health()
    assert all(not p.is_alive() for p in processes)  # the survivor was stopped
    with pytest.raises(RuntimeError, match="rank 0"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    llm.shutdown()


@pytest.mark.parametrize("how", ["exit", "sigterm", "sigkill"])
def test_engine_end_leaves_no_workers(llama_folder, how):
    """However the engine process ends (a normal exit without shutdown(), SIGTERM, or
    SIGKILL with no cleanup at all), its workers end too, promptly."""
    script = textwrap.dedent(f"""
        import sys
        from inference import LLM
        if __name__ == "__main__":
            llm = LLM({str(llama_folder)!r}, tensor_parallel_size=2, device="cpu",
                      max_model_len=128)
            print(" ".join(str(p.pid) for p in llm.engine.runner.processes), flush=True)
            sys.stdin.readline()  # then exit, without calling shutdown()
    """)
    engine = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env=os.environ.copy(),
    )
    try:
        line = engine.stdout.readline()
        assert line, "the engine process did not start its workers"
        pids = [int(pid) for pid in line.split()]
        assert all(_alive(pid) for pid in pids)
        if how == "exit":
            engine.stdin.write("\n")
            engine.stdin.flush()
        else:
            engine.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        assert engine.wait(timeout=15) == (0 if how == "exit" else -getattr(signal, how.upper()))
    finally:
        engine.kill()
        engine.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie does not count: it has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_closed_engine_refuses_work(llama_folder):
    llm = LLM(str(llama_folder), tensor_parallel_size=2, device="cpu", max_model_len=128)
    processes = llm.engine.runner.processes
    llm.shutdown()
    llm.shutdown()  # idempotent
    assert all(not p.is_alive() and p.exitcode == 0 for p in processes)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)


def test_worker_profile_writes_rank0_table(llama_folder, tmp_path, monkeypatch):
    """PAGODA_WORKER_PROFILE: rank 0 profiles the chosen steps and writes a ranked table."""
    report = tmp_path / "rank0.txt"
    monkeypatch.setenv("PAGODA_WORKER_PROFILE", f"{report}:2:3")
    with LLM(str(llama_folder), tensor_parallel_size=2, device="cpu", max_model_len=128) as llm:
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    header, columns, *rows = report.read_text().splitlines()
    assert header.startswith("rank 0, steps 2..4:") and "ms/step wall" in header
    assert columns.split()[:3] == ["us/step", "calls/step", "us/call"] and rows


# -- configuration -------------------------------------------------------------------------


def test_split_sizes():
    assert [kv_head_range(8, r, 4) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    # Fewer KV heads than ranks: each rank holds the one its query heads use.
    assert [kv_head_range(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [kv_head_range(1, r, 2) for r in range(2)] == [(0, 1), (0, 1)]
    assert vocab_range(321, 0, 2) == (0, 161, 161)
    assert vocab_range(321, 1, 2) == (161, 161, 160)
    assert vocab_range(320, 0, 1) == (0, 320, 320)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "intermediate", "tp", "message"),
    [
        (4, 2, 128, 8, "must divide the model's num_attention_heads"),
        (12, 3, 128, 2, "num_key_value_heads \\(3\\) and tensor_parallel_size=2"),
        (8, 8, 130, 4, "must divide the model's intermediate_size"),
    ],
)
def test_unsplittable_models_are_refused(heads, kv_heads, intermediate, tp, message):
    with pytest.raises(ValueError, match=message):
        check_divisible(heads, kv_heads, intermediate, tp)


def test_engine_refuses_unsplittable_model_before_loading(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }))
    # No weights in the folder: the check comes first.
    with pytest.raises(ValueError, match="tensor_parallel_size=8 must divide"):
        LLM(str(tmp_path), tensor_parallel_size=8, device="cpu")
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1, 2, 4 or 8"):
        LLM(str(tmp_path), tensor_parallel_size=3, device="cpu")


# -- speculative decoding --------------------------------------------------------------


def test_ngram_speculation_matches_single_rank_plain_decoding(tmp_path):
    """n-gram drafts are proposed in the engine process and verified by every rank: each
    worker expands a sequence's sampling state to one row per position it verifies. On a
    model that cycles (drafts accepted), greedy and seeded sampling with drafts over two
    ranks give the single-rank engine's tokens without drafts (greedy) and with them
    (seeded: the same draws, position by position, in the same scheduling mode)."""
    from tiny_models import build_successor_model

    cycle = {10: 11, 11: 12, 12: 13, 13: 14, 14: 10, 20: 21, 21: 22, 22: 20}
    build_successor_model(tmp_path, cycle)
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
             "prompt_lookup_min": 2}
    prompts = [[10, 11, 12, 13, 14, 10, 11], [20, 21, 22, 20, 21], [12, 13, 14, 10, 11] * 3]
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True)
    params = [GREEDY, GREEDY, seeded]

    def run(tp: int, **kwargs) -> tuple[list[list[int]], object]:
        with LLM(str(tmp_path), tensor_parallel_size=tp, **ENGINE_ARGS, **kwargs) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            counters = None if llm.engine.spec_decoder is None else llm.engine.spec_decoder.counters
            return [o.outputs[0].token_ids for o in outs], counters

    plain, _ = run(1)
    for async_scheduling in (True, False):  # seeded draws differ between the two modes
        single, _ = run(1, speculative_config=ngram, async_scheduling=async_scheduling)
        tokens, counters = run(2, speculative_config=ngram, async_scheduling=async_scheduling)
        assert tokens[:2] == plain[:2]
        assert tokens == single
        assert counters.num_accepted_tokens > counters.num_drafts > 0, counters
