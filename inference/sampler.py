"""Batched token sampling with vLLM-V1 semantics.

The model runner calls the sampler once per step with one row of logits per sequence. All the
work happens on the logits' device, batched over rows; what comes back to the host is the chosen
id per row and, only for rows that ask, their logprobs, in a single transfer.

Structured outputs come first: the grammar bitmask of the constrained rows sets the tokens
their grammar forbids to -inf, so everything after it (sampling and logprobs, as in vLLM)
sees only what the grammar allows. Then, as in vLLM V1's sampler: min_tokens masking, logit
bias, penalties, then greedy rows take the argmax while the others go through temperature,
min-p, top-k, top-p and an exponential race. min-p comes first, on the whole (tempered)
distribution, as vLLM V1's min-p logits processor does: its cut (probability below min_p
times the largest) would be the same after top-k, but top-p's mass then counts only what
min-p kept. Logprobs describe the distribution before all of that but the grammar's mask
(the raw one for unconstrained rows), as vLLM V1 reports them by default.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

import pagoda_kernels as kernels
from inference.sampling_params import SamplingParams
from inference.spec_decode.rejection import accept_or_residual, flat_drafts

# Columns of the per-row scalar table built once per step (one host-to-device copy).
_TEMPERATURE, _TOP_K, _TOP_P, _MIN_P, _REPETITION, _FREQUENCY, _PRESENCE, _GREEDY = range(8)


@dataclass
class PromptLogprobsRequest:
    """One sequence's prompt logprobs wanted from this step: the hidden states of
    ``num_positions`` consecutive query tokens, from the ``first``-th of its row's query,
    each scored against the prompt token that follows it (``target_ids``)."""

    row: int  # the sequence's row in the step
    first: int
    num_positions: int
    target_ids: list[int]
    num_logprobs: int  # the top alternatives wanted besides the prompt token


@dataclass
class PromptLogprobs:
    """The answer to one ``PromptLogprobsRequest``, on the host: per position, the target
    token's logprob and rank (1 = most likely), and the most likely tokens, best first."""

    row: int
    token_logprobs: list[float]
    ranks: list[int]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class SamplingMetadata:
    params: list[SamplingParams]  # one per row
    prompt_token_ids: list[list[int]]  # per row
    output_token_ids: list[list[int]]  # per row, tokens generated before this step
    generators: list[torch.Generator | None]  # per row; set for seeded requests
    # per row, tokens generated so far (min_tokens); None: len(output_token_ids), for callers
    # that pass every row's full output
    num_output_tokens: list[int] | None = None
    # Rows of the step (any, not only sampled ones) whose prompt logprobs are wanted.
    prompt_logprobs: list[PromptLogprobsRequest] = field(default_factory=list)
    # Structured outputs: the allowed next tokens of the rows at ``bitmask_rows``, one int32
    # row of bits each (bit t % 32 of word t // 32). The engine may give
    # ``fill_token_bitmask`` instead, called once the step's forward pass has been queued
    # (on a GPU the host fills the mask while the device runs the model).
    token_bitmask: np.ndarray | None = None
    bitmask_rows: list[int] | None = None
    fill_token_bitmask: Callable[[], np.ndarray] | None = None
    # Speculative decoding: per sampled row, the drafts its query verifies. The other
    # per-row lists then hold one entry per expanded row (each draft's position, then one
    # more: ``inference.spec_decode.rejection``); None: one position per row.
    draft_token_ids: list[list[int]] | None = None

    def resolve_token_bitmask(self) -> np.ndarray | None:
        if self.fill_token_bitmask is not None:
            self.token_bitmask = self.fill_token_bitmask()
            self.fill_token_bitmask = None
        return self.token_bitmask

    def output_counts(self) -> list[int]:
        if self.num_output_tokens is not None:
            return self.num_output_tokens
        return [len(ids) for ids in self.output_token_ids]


@dataclass
class RowLogprobs:
    sampled_logprob: float
    sampled_rank: int  # 1 = most likely under the raw distribution
    top_token_ids: list[int]  # params.logprobs most likely tokens, most likely first
    top_logprobs: list[float]


@dataclass
class SamplerOutput:
    token_ids: list[int]  # chosen token per row
    logprobs: list[RowLogprobs | None]  # None where params.logprobs is None
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)


# Hidden states turned into full-vocabulary logits at a time for prompt logprobs: a whole
# prefill chunk at once would need chunk x vocabulary floats (16k x 152k: 10 GB); 256 rows
# of a 152k vocabulary take about 160 MB per intermediate.
_PROMPT_LOGPROBS_ROWS = 256


def compute_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    query_start_loc: np.ndarray,
    requests: list[PromptLogprobsRequest],
) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Prompt logprobs from a step's hidden states, left on the device: per request, its
    row, the targets' logprobs and ranks, and the top-k ids and logprobs. Raw distribution
    (no temperature or penalties), as vLLM reports them."""
    results = []
    for request in requests:
        start = int(query_start_loc[request.row]) + request.first
        targets = _to_device(request.target_ids, torch.int64, hidden.device)
        parts: list[list[torch.Tensor]] = [[], [], [], []]
        for offset in range(0, request.num_positions, _PROMPT_LOGPROBS_ROWS):
            end = min(offset + _PROMPT_LOGPROBS_ROWS, request.num_positions)
            logprobs = compute_logits(hidden[start + offset : start + end]).log_softmax(dim=-1)
            chosen = logprobs.gather(1, targets[offset:end].unsqueeze(1))
            top = logprobs.topk(request.num_logprobs, dim=-1)
            parts[0].append(chosen.squeeze(1))
            parts[1].append((logprobs > chosen).sum(dim=-1) + 1)
            parts[2].append(top.indices)
            parts[3].append(top.values)
        results.append((request.row, *(torch.cat(p) for p in parts)))
    return results


def prompt_logprobs_to_host(
    results: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
) -> list[PromptLogprobs]:
    return [
        PromptLogprobs(
            row, chosen.tolist(), ranks.tolist(), top_ids.tolist(), top_values.tolist()
        )
        for row, chosen, ranks, top_ids, top_values in results
    ]


def _to_device(data: object, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host data to `device` without a blocking copy: a pageable copy would wait for the GPU."""
    tensor = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]
) -> torch.Tensor:
    """In place: -inf wherever row ``rows[i]``'s bitmask ``bitmask[i]`` has a 0 bit; other
    rows untouched. ``rows`` ascend; tokens past the bitmask's width are forbidden. Only
    the packed words cross to the device; one kernel masks them (``kernels.token_bitmask``).
    Returns ``logits``."""
    device = logits.device
    words = _to_device(torch.from_numpy(bitmask), torch.int32, device)
    index = None
    if len(rows) != logits.shape[0]:
        index = _to_device(torch.tensor(rows, dtype=torch.int64), torch.int64, device)
    return kernels.apply_token_bitmask(logits, words, index)


def has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _row_scalars(params: list[SamplingParams], device: torch.device) -> torch.Tensor:
    # Greedy rows get neutral sampling knobs so that the batched random path leaves them alone
    # (and temperature 0 never reaches a division).
    rows = [
        [1.0, 0, 1.0, 0.0, p.repetition_penalty, p.frequency_penalty, p.presence_penalty, 1.0]
        if p.greedy
        else [
            p.temperature,
            p.top_k,
            p.top_p,
            p.min_p,
            p.repetition_penalty,
            p.frequency_penalty,
            p.presence_penalty,
            0.0,
        ]
        for p in params
    ]
    return _to_device(rows, torch.float32, device)


def mask_stop_tokens_for_min_tokens(
    logits: torch.Tensor, metadata: SamplingMetadata
) -> torch.Tensor:
    """Forbid every stop token of rows that have not yet produced `min_tokens` tokens."""
    rows: list[int] = []
    cols: list[int] = []
    vocab_size = logits.shape[-1]
    counts = metadata.output_counts()
    for row, (p, count) in enumerate(zip(metadata.params, counts, strict=True)):
        if count < p.min_tokens:
            ids = [t for t in p.all_stop_token_ids | set(p.stop_token_ids) if t < vocab_size]
            rows += [row] * len(ids)
            cols += ids
    if not rows:
        return logits
    index = _to_device([rows, cols], torch.int64, logits.device)
    minus_inf = torch.full((len(rows),), float("-inf"), device=logits.device)
    return logits.index_put((index[0], index[1]), minus_inf)


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Add each row's ``logit_bias`` to its logits (ids beyond the vocabulary are ignored:
    the server rejects them, and a padded LM head may be wider than the tokenizer)."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    vocab_size = logits.shape[-1]
    for row, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            if token_id < vocab_size:
                rows.append(row)
                cols.append(token_id)
                values.append(bias)
    if not rows:
        return logits
    index = _to_device([rows, cols], torch.int64, logits.device)
    bias = _to_device(values, torch.float32, logits.device)
    return logits.index_put((index[0], index[1]), bias, accumulate=True)


def _token_counts(
    token_lists: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[len(token_lists), V] occurrence counts, from one flat id tensor and one scatter_add."""
    counts = torch.zeros(len(token_lists) * vocab_size, dtype=torch.float32, device=device)
    lengths = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
    total = int(lengths.sum())
    if total:
        # Flat rather than padded: one long prompt in the batch must not pad every other row.
        # np.fromiter reads Python ints several times faster than torch.tensor(list).
        flat_ids = np.fromiter(chain.from_iterable(token_lists), dtype=np.int64, count=total)
        rows = np.repeat(np.arange(len(token_lists), dtype=np.int64), lengths)
        index = _to_device(torch.from_numpy(rows * vocab_size + flat_ids), torch.int64, device)
        counts.scatter_add_(0, index, torch.ones(index.shape, device=device))
    return counts.view(len(token_lists), vocab_size)


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Repetition (prompt + output), frequency and presence (output only) penalties.

    `repetition`, `frequency` and `presence` are [B] tensors on the logits' device. Callers may
    pass empty token lists for rows whose penalties are neutral, to keep the transfer small.
    """
    batch, vocab_size = logits.shape
    counts = _token_counts([*prompt_token_ids, *output_token_ids], vocab_size, logits.device)
    prompt_counts, output_counts = counts[:batch], counts[batch:]
    seen = (prompt_counts + output_counts) > 0
    rep = repetition.unsqueeze(1)
    # As in HF and vLLM: shrink positive logits, push negative ones further down.
    repeated = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, repeated, logits)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * (output_counts > 0)


def _top_k_threshold_by_topk(
    logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int
) -> torch.Tensor:
    # torch.topk over max_top_k columns is far cheaper than a full-vocabulary sort.
    values = logits.topk(max_top_k, dim=-1).values
    k = top_k.clamp(1, max_top_k)
    threshold = values.gather(1, (k - 1).unsqueeze(1))
    return torch.where((top_k <= 0).unsqueeze(1), float("-inf"), threshold)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """Set truncated tokens to -inf. Each argument is a [B] tensor, or None if off for all rows.

    Applied in vLLM V1's order: min-p first drops tokens whose probability is below min_p
    times the largest one; then top-k (top_k <= 0 disables it for that row; ties with the
    k-th largest logit are kept); then top-p keeps the most likely remaining tokens until
    their renormalised mass reaches top_p (top_p >= 1 keeps all). `max_top_k`, the largest
    enabled k, lets the top-k-only case avoid a full sort.
    """
    vocab_size = logits.shape[-1]
    if min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if top_k is not None:
        top_k = torch.where(top_k >= vocab_size, 0, top_k)
    if top_p is not None:
        logits = _apply_top_k_top_p_sorted(logits, top_k, top_p)
    elif top_k is not None:
        max_k = min(max_top_k or vocab_size, vocab_size)
        threshold = _top_k_threshold_by_topk(logits, top_k, max_k)
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    return logits


def _apply_top_k_top_p_sorted(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        k = torch.where(top_k <= 0, vocab_size, top_k)
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p == 1 must keep everything even where float32 cumulative sums overshoot 1.
    limit = torch.where(top_p >= 1.0, float("inf"), top_p).unsqueeze(1)
    drop = mass_before >= limit
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_top_k_top_p_min_p_reference(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]
) -> torch.Tensor:
    """Straightforward per-row version of the truncation (min-p, top-k, top-p); returns the
    [B, V] keep mask."""
    keep = torch.zeros(logits.shape, dtype=torch.bool)
    for row, values in enumerate(logits.double().cpu().tolist()):
        order = sorted(range(len(values)), key=lambda t: -values[t])
        kept = order
        if min_p[row] > 0.0:
            weights = _softmax_weights(values, kept)
            largest = max(weights.values())
            kept = [t for t in kept if weights[t] >= min_p[row] * largest]
        if 0 < top_k[row] < len(kept):
            kth = values[kept[top_k[row] - 1]]
            kept = [t for t in kept if values[t] >= kth]
        if top_p[row] < 1.0:
            weights = _softmax_weights(values, kept)
            mass, nucleus = 0.0, []
            for t in kept:
                if nucleus and mass >= top_p[row]:
                    break
                nucleus.append(t)
                mass += weights[t]
            kept = nucleus
        keep[row, kept] = True
    return keep


def _softmax_weights(values: list[float], kept: list[int]) -> dict[int, float]:
    top = max(values[t] for t in kept)
    exps = {t: math.exp(values[t] - top) for t in kept}
    total = sum(exps.values())
    return {t: e / total for t, e in exps.items()}


def _exponential_race(
    probs: torch.Tensor, sampling_rows: list[bool], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """argmax(probs / q) with q ~ Exp(1) picks token t with probability probs[t]."""
    noise = torch.empty_like(probs).exponential_()
    for row, generator in enumerate(generators):
        # A seeded row's noise comes only from its own generator, one [V] draw per step, so
        # its tokens do not depend on its batch-mates or its position in the batch.
        if generator is not None and sampling_rows[row]:
            noise[row].exponential_(generator=generator)
    # Exp(1) can round to 0; 0/0 would be NaN, which argmax would pick.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def _sample_random_rows(
    logits: torch.Tensor,
    scalars: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    drafts: torch.Tensor | None = None,
) -> torch.Tensor:
    vocab_size = logits.shape[-1]
    sampling = [not p.greedy for p in params]
    live = [p for p in params if not p.greedy]
    top_ks = [p.top_k for p in live if 0 < p.top_k < vocab_size]
    logits = logits / scalars[:, _TEMPERATURE : _TEMPERATURE + 1]
    logits = apply_top_k_top_p_min_p(
        logits,
        top_k=scalars[:, _TOP_K].long() if top_ks else None,
        top_p=scalars[:, _TOP_P] if any(p.top_p < 1.0 for p in live) else None,
        min_p=scalars[:, _MIN_P] if any(p.min_p > 0.0 for p in live) else None,
        max_top_k=max(top_ks, default=None),
    )
    probs = logits.softmax(dim=-1)
    if drafts is None:
        return _exponential_race(probs, sampling, generators)
    # Rejection sampling of the drafts: accepted ones stand, the others are resampled
    # from what is left of the target's distribution.
    accepted, residual = accept_or_residual(probs, drafts, generators, sampling)
    return torch.where(accepted, drafts, _exponential_race(residual, sampling, generators))


def _pack_logprobs(
    raw_logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
) -> torch.Tensor:
    """Sampled ids, their ranks and logprobs, and each row's top logprobs, packed in one
    float64 tensor (which holds ids and ranks exactly) so they come back in one transfer."""
    # Computed for every row: on the GPU that is cheaper than gathering the rows that asked.
    logprobs = raw_logits.log_softmax(dim=-1)
    sampled = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > sampled).sum(dim=-1) + 1
    num_top = max(p.logprobs or 0 for p in params)
    top = logprobs.topk(num_top, dim=-1)
    return torch.cat(
        [
            token_ids.double(),
            ranks.double(),
            sampled.squeeze(1).double(),
            top.indices.double().flatten(),
            top.values.double().flatten(),
        ]
    )


def _unpack_logprobs(
    packed: list[float], params: list[SamplingParams]
) -> tuple[list[int], list[RowLogprobs | None]]:
    batch = len(params)
    num_top = max(p.logprobs or 0 for p in params)
    ids = [int(t) for t in packed[:batch]]
    top_ids = packed[3 * batch : 3 * batch + batch * num_top]
    top_values = packed[3 * batch + batch * num_top :]
    rows: list[RowLogprobs | None] = []
    for row, p in enumerate(params):
        if p.logprobs is None:
            rows.append(None)
            continue
        start = row * num_top
        rows.append(
            RowLogprobs(
                sampled_logprob=packed[2 * batch + row],
                sampled_rank=int(packed[batch + row]),
                top_token_ids=[int(t) for t in top_ids[start : start + p.logprobs]],
                top_logprobs=top_values[start : start + p.logprobs],
            )
        )
    return ids, rows


class SampledTokens:
    """A step's sampling result while it may still be on its way from the device.

    ``token_ids`` stays on the device (the next step can read it there before the host has
    seen it); ``start_copy_to_host`` queues the one device-to-host transfer behind the
    step's work and ``to_host`` waits for it."""

    def __init__(
        self, token_ids: torch.Tensor, logprob_pack: torch.Tensor | None,
        params: list[SamplingParams],
    ) -> None:
        self.token_ids = token_ids
        self._payload = logprob_pack if logprob_pack is not None else token_ids
        self._has_logprobs = logprob_pack is not None
        self._params = params
        self._ready: torch.cuda.Event | None = None

    def start_copy_to_host(self) -> SampledTokens:
        payload = self._payload
        if payload.device.type == "cuda":
            host = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=True)
            host.copy_(payload, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
            self._payload = host
        return self

    def to_host(self) -> SamplerOutput:
        if self._ready is not None:
            self._ready.synchronize()
        values = self._payload.tolist()
        if not self._has_logprobs:
            return SamplerOutput(values, [None] * len(values))
        return SamplerOutput(*_unpack_logprobs(values, self._params))


class Sampler:
    """Picks one token per row of a [B, V] float32 logits tensor (CPU or CUDA). The grammar
    mask of constrained rows is applied to ``logits`` in place."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        return self.sample(logits, metadata).to_host()

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SampledTokens:
        """Everything on the logits' device; nothing is read back here."""
        params = metadata.params
        logits = logits.float()
        bitmask = metadata.resolve_token_bitmask()
        if bitmask is not None:
            logits = apply_token_bitmask(logits, bitmask, metadata.bitmask_rows or [])
        all_greedy = all(p.greedy for p in params)
        penalized = [has_penalties(p) for p in params]
        wants_logprobs = any(p.logprobs is not None for p in params)
        in_min_tokens = any(
            count < p.min_tokens
            for p, count in zip(params, metadata.output_counts(), strict=True)
        )
        biased = any(p.logit_bias for p in params)
        if all_greedy and not (any(penalized) or in_min_tokens or wants_logprobs or biased):
            return SampledTokens(logits.argmax(dim=-1), None, params)

        scalars = _row_scalars(params, logits.device)
        processed = mask_stop_tokens_for_min_tokens(logits, metadata)
        if biased:
            processed = apply_logit_bias(processed, params)
        if any(penalized):
            processed = apply_penalties(
                processed,
                [
                    ids if p.repetition_penalty != 1.0 else []
                    for p, ids in zip(params, metadata.prompt_token_ids, strict=True)
                ],
                [
                    ids if pen else []
                    for pen, ids in zip(penalized, metadata.output_token_ids, strict=True)
                ],
                scalars[:, _REPETITION],
                scalars[:, _FREQUENCY],
                scalars[:, _PRESENCE],
            )
        if all_greedy:
            token_ids = processed.argmax(dim=-1)
        else:
            drafts = None
            if metadata.draft_token_ids is not None:
                drafts = _to_device(flat_drafts(metadata.draft_token_ids), torch.int64,
                                    logits.device)
            token_ids = _sample_random_rows(
                processed, scalars, params, metadata.generators, drafts)
            if any(p.greedy for p in params):
                greedy_rows = scalars[:, _GREEDY] > 0
                token_ids = torch.where(greedy_rows, processed.argmax(dim=-1), token_ids)
        pack = _pack_logprobs(logits, token_ids, params) if wants_logprobs else None
        return SampledTokens(token_ids, pack, params)
