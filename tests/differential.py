"""Differential testing of the engine against transformers' own forward.

The engine runs a randomized workload (random prompt lengths from 1 token to near
``max_model_len``, shared prefixes that are block-aligned and not, exact duplicates, a
prompt that is the prefix of another, requests arriving between steps, aborts, ``n > 1``,
seeded sampling) under one engine configuration. Every token it produced is then scored by
transformers, teacher-forced on the engine's own tokens: the engine's logprob of each token
must equal transformers' logprob of that token at that position, and a greedy token must be
transformers' argmax (up to ties). This compares every fast path (kernels, CUDA graphs,
async scheduling, chunking, prefix cache, preemption, tensor parallelism) with one
independent implementation, position by position, instead of comparing two runs of the
engine with each other.

Models are built with sharp attention (``tiny_models.build_tiny_model(qk_scale=...)``), so
that attending to a wrong block, position or sequence changes the logprobs visibly.

Used by ``tests/engine/test_differential.py`` (CPU, in CI) and
``tests/gpu/test_differential_gpu.py`` (the H200 suite).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from inference import SamplingParams


@dataclass
class Req:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_step: int = 0  # engine steps to run before this request is added
    abort_step: int | None = None  # abort once this many steps have run


@dataclass
class Workload:
    requests: list[Req]

    def describe(self) -> str:
        lengths = sorted(len(r.prompt) for r in self.requests)
        return (
            f"{len(self.requests)} requests, prompt lengths {lengths}, "
            f"{sum(r.arrival_step > 0 for r in self.requests)} late arrivals, "
            f"{sum(r.abort_step is not None for r in self.requests)} aborts"
        )


def random_workload(
    seed: int,
    *,
    vocab_size: int,
    max_model_len: int,
    block_size: int,
    num_requests: int = 16,
    max_new_tokens: int = 12,
    long_prompts: bool = True,
) -> Workload:
    """A seeded random workload; see the module docstring for what it mixes."""
    rng = np.random.default_rng(seed)
    low = 3  # skip the special tokens of the tiny models' tokenizers

    def tokens(n: int) -> list[int]:
        return rng.integers(low, vocab_size, n).tolist()

    def room(n_new: int) -> int:
        return max_model_len - n_new  # prompt + max_tokens must fit

    longest = room(max_new_tokens) if long_prompts else min(room(max_new_tokens), 96)
    # Shared prefixes: one block-aligned, one not, one long.
    prefixes = [
        tokens(block_size * int(rng.integers(1, 4))),
        tokens(int(rng.integers(1, 3 * block_size)) | 1),
        tokens(int(rng.integers(longest // 2, longest - 1))),
    ]
    requests: list[Req] = []
    for i in range(num_requests):
        new_tokens = int(rng.integers(1, max_new_tokens + 1))
        limit = min(longest, room(new_tokens))
        kind = rng.choice(["fresh", "prefix", "prefix", "duplicate", "prefix_of", "longest"])
        earlier = [r.prompt for r in requests]
        if kind == "duplicate" and earlier:
            prompt = list(earlier[int(rng.integers(len(earlier)))])
        elif kind == "prefix_of" and earlier:
            source = earlier[int(rng.integers(len(earlier)))]
            prompt = source[: int(rng.integers(1, len(source) + 1))]
        elif kind == "prefix":
            prefix = prefixes[int(rng.integers(len(prefixes)))]
            prompt = prefix + tokens(int(rng.integers(0, 2 * block_size + 3)))
        elif kind == "longest":
            prompt = tokens(limit)
        else:
            prompt = tokens(int(rng.integers(1, limit + 1)))
        prompt = prompt[:limit] or tokens(1)
        if rng.random() < 0.25:  # seeded sampling, sometimes several samples
            params = SamplingParams(
                temperature=0.8, top_p=0.9, seed=int(rng.integers(1 << 30)),
                n=int(rng.integers(1, 3)), max_tokens=new_tokens, ignore_eos=True, logprobs=0,
            )
        else:
            params = SamplingParams(
                temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=0
            )
        arrival = 0 if rng.random() < 0.6 else int(rng.integers(1, 24))
        abort = arrival + int(rng.integers(1, 12)) if rng.random() < 0.12 else None
        requests.append(Req(f"req-{i}", prompt, params, arrival, abort))
    return Workload(requests)


@dataclass
class SeqResult:
    request_id: str
    index: int
    prompt: list[int]
    token_ids: list[int]
    logprobs: list[float]  # the engine's logprob of each of its tokens
    greedy: bool
    finish_reason: str | None


def run_workload(engine, workload: Workload, max_steps: int = 200_000) -> list[SeqResult]:
    """Drive ``engine`` (an ``LLMEngine``) step by step: add requests when their arrival
    step comes, abort them when their abort step comes. Returns every sequence's tokens,
    aborted ones with what they had produced."""
    by_arrival = sorted(workload.requests, key=lambda r: r.arrival_step)
    aborts = [r for r in workload.requests if r.abort_step is not None]
    last: dict[str, object] = {}
    step = 0
    added = 0
    while added < len(by_arrival) or engine.has_unfinished_requests():
        while added < len(by_arrival) and by_arrival[added].arrival_step <= step:
            r = by_arrival[added]
            engine.add_request(r.request_id, r.prompt, r.params)
            added += 1
        for r in aborts:
            if r.abort_step == step:
                engine.abort_request(r.request_id)
        for output in engine.step():
            last[output.request_id] = output
        step += 1
        assert step < max_steps, "the engine made no progress"
    results = []
    for r in workload.requests:
        output = last[r.request_id]
        assert output.finished, r.request_id
        for completion in output.outputs:
            results.append(
                SeqResult(
                    r.request_id, completion.index, r.prompt, list(completion.token_ids),
                    [d[t].logprob for d, t in zip(completion.logprobs, completion.token_ids)],
                    r.params.temperature == 0, completion.finish_reason,
                )
            )
    return results


def check_results_complete(workload: Workload, results: list[SeqResult]) -> None:
    """Every request that was not aborted produced exactly ``max_tokens`` per sample."""
    by_id = {r.request_id: r for r in workload.requests}
    for res in results:
        params = by_id[res.request_id].params
        if res.finish_reason == "abort":
            assert by_id[res.request_id].abort_step is not None
            assert len(res.token_ids) <= params.max_tokens
        else:
            assert res.finish_reason == "length", (res.request_id, res.finish_reason)
            assert len(res.token_ids) == params.max_tokens, res.request_id


class Reference:
    """transformers' log-softmax at every position of prompt + generated tokens, one
    forward per distinct sequence (duplicates and ``n`` identical samples share it)."""

    def __init__(self, model, device: str | torch.device = "cpu") -> None:
        self.model = model
        self.device = torch.device(device)
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.no_grad()
    def logprobs(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """[len(tokens), vocab] float32: the distribution each token was drawn from."""
        if not tokens:
            return torch.empty(0)
        key = tuple(prompt + tokens[:-1])
        if key not in self._cache:
            ids = torch.tensor([list(key)], device=self.device)
            logits = self.model(ids).logits[0, len(prompt) - 1 :].float()
            self._cache[key] = torch.log_softmax(logits, dim=-1).cpu()
        return self._cache[key]


def fp8_kv_model(model, scales: dict[int, tuple[float, float]] | None = None):
    """A copy of transformers ``model`` whose attention reads its keys (after rotary) and
    values as an FP8 KV cache holds them: divided by the layer's (k_scale, v_scale)
    (``scales[layer]``, default 1.0), saturated to +-448, rounded to e4m3 and multiplied
    back (``kernels.kv_cache``'s references). The reference of the engine with
    ``kv_cache_dtype="fp8"``: the same quantization, float32 everywhere else."""
    import copy

    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from pagoda_kernels.kv_cache import dequantize_kv_ref, quantize_kv_ref

    def through_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
        scale_tensor = torch.tensor([scale], device=x.device)
        return dequantize_kv_ref(quantize_kv_ref(x, scale_tensor), scale_tensor).to(x.dtype)

    def attention(module, query, key, value, *args, **kwargs):
        k_scale, v_scale = (scales or {}).get(module.layer_idx, (1.0, 1.0))
        key, value = through_fp8(key, k_scale), through_fp8(value, v_scale)
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register("pagoda_fp8_kv", attention)
    quantized = copy.deepcopy(model)
    quantized.set_attn_implementation("pagoda_fp8_kv")
    return quantized


@dataclass
class Report:
    num_tokens: int = 0
    num_greedy_tokens: int = 0
    max_abs_diff: float = 0.0
    sum_abs_diff: float = 0.0
    argmax_mismatches: int = 0  # greedy tokens that are not the argmax, ties excluded
    ties: int = 0
    max_regret: float = 0.0  # how much less likely than the argmax a greedy token was
    worst: tuple = ()
    diffs: list[float] = field(default_factory=list, repr=False)

    @property
    def mean_abs_diff(self) -> float:
        return self.sum_abs_diff / max(self.num_tokens, 1)

    def summary(self) -> str:
        return (
            f"{self.num_tokens} tokens ({self.num_greedy_tokens} greedy): max |dlogprob| "
            f"{self.max_abs_diff:.2e}, mean {self.mean_abs_diff:.2e}, argmax mismatches "
            f"{self.argmax_mismatches} (+{self.ties} ties), max regret {self.max_regret:.2e}, "
            f"worst {self.worst}"
        )


def compare(results: list[SeqResult], reference: Reference, tie_tol: float = 1e-3) -> Report:
    report = Report()
    for res in results:
        ref = reference.logprobs(res.prompt, res.token_ids)
        for pos, (token, engine_lp) in enumerate(zip(res.token_ids, res.logprobs)):
            row = ref[pos]
            ref_lp = float(row[token])
            diff = abs(engine_lp - ref_lp)
            report.num_tokens += 1
            report.sum_abs_diff += diff
            report.diffs.append(diff)
            if diff > report.max_abs_diff:
                report.max_abs_diff = diff
                report.worst = (res.request_id, res.index, pos, engine_lp, ref_lp)
            if res.greedy:
                report.num_greedy_tokens += 1
                regret = float(row.max()) - ref_lp
                report.max_regret = max(report.max_regret, regret)
                if int(row.argmax()) != token:
                    if regret <= tie_tol:
                        report.ties += 1
                    else:
                        report.argmax_mismatches += 1
    return report


def bf16_noise(results: list[SeqResult], ref32: Reference, ref16: Reference) -> float:
    """transformers-bfloat16's own mean |logprob - float32 logprob| on the engine's tokens:
    the noise a bfloat16 engine is judged against."""
    total, count = 0.0, 0
    for res in results:
        a = ref32.logprobs(res.prompt, res.token_ids)
        b = ref16.logprobs(res.prompt, res.token_ids)
        for pos, token in enumerate(res.token_ids):
            total += abs(float(a[pos, token]) - float(b[pos, token]))
            count += 1
    return total / max(count, 1)


# The engine settings every differential run is drawn from (the matrix).
BUDGETS = (32, 256, 2048, None)  # None: the engine's default


def settings_matrix(
    budgets=BUDGETS,
    prefix_caching=(True, False),
    async_scheduling=(True, False),
    enforce_eager=(False, True),
    block_sizes=(16, 32),
    preemption=(False, True),
) -> list[dict]:
    """The full cross product of the given settings, as engine-argument dicts (with a
    ``preempt`` flag that the caller turns into a small ``num_kv_blocks``)."""
    rows = []
    for budget, cache, asyn, eager, block, preempt in itertools.product(
        budgets, prefix_caching, async_scheduling, enforce_eager, block_sizes, preemption
    ):
        rows.append(dict(
            max_num_batched_tokens=budget, enable_prefix_caching=cache,
            async_scheduling=asyn, enforce_eager=eager, block_size=block, preempt=preempt,
        ))  # fmt: skip
    return rows


def engine_args(setting: dict, max_model_len: int) -> dict:
    """Engine keyword arguments for one row of ``settings_matrix``."""
    args = {k: v for k, v in setting.items() if k != "preempt" and v is not None}
    if setting.get("preempt"):
        # Room for one longest request and a little more: the workload needs far more,
        # so sequences are preempted and recomputed.
        block = setting["block_size"]
        args["num_kv_blocks"] = -(-max_model_len // block) + 3
    return args


def setting_id(setting: dict) -> str:
    parts = [
        f"budget{setting['max_num_batched_tokens'] or 'default'}",
        "cache" if setting["enable_prefix_caching"] else "nocache",
        "async" if setting["async_scheduling"] else "sync",
        "eager" if setting["enforce_eager"] else "graphs",
        f"bs{setting['block_size']}",
    ]
    if setting.get("preempt"):
        parts.append("preempt")
    return "-".join(parts)
