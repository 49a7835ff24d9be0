"""The device side of verifying drafts: which hidden states to score, and how to choose.

A speculating row's query is its last token plus ``k`` drafts; the target model's logits
at those ``k + 1`` positions are the distributions of the row's next ``k + 1`` tokens,
each given that the drafts before it were right. The sampler sees them as ``k + 1`` rows
("expanded rows", one per position) and picks a token at each; the host keeps the
longest prefix where the pick equals the draft, plus the pick after it.

Rejection sampling keeps the target's distribution exactly (Leviathan et al., 2023; Chen
et al., 2023). With a proposer whose draft distribution q is a point mass on draft x (the
n-gram proposer), the rule reduces to: accept x with probability p(x); otherwise sample
from max(p - q, 0) normalised, which is p with x removed, renormalised. The chosen token
then has distribution p(x)·[t = x] + (1 - p(x))·p(t)/(1 - p(x))·[t != x] = p(t). Greedy
rows need no randomness: the pick is the argmax, accepted when it equals the draft.
"""

from __future__ import annotations

import numpy as np
import torch

NO_DRAFT = -1  # an expanded row with no draft to verify: the token after all the drafts


def flat_drafts(draft_token_ids: list[list[int]]) -> list[int]:
    """Per expanded row, the draft its pick is compared with (``NO_DRAFT`` for each
    sampled row's last position). Expanded rows are, per sampled row, its drafts'
    positions then one more."""
    flat: list[int] = []
    for drafts in draft_token_ids:
        flat += drafts
        flat.append(NO_DRAFT)
    return flat


def verify_rows(last_rows: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """The hidden-state rows to score: for a sampled row whose last query token is at
    ``last_rows[i]``, the ``num_drafts[i] + 1`` rows ending there."""
    counts = num_drafts + 1
    first = np.repeat(last_rows - num_drafts, counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return first + (np.arange(int(counts.sum())) - starts)


def accept_or_residual(
    probs: torch.Tensor, drafts: torch.Tensor,
    generators: list[torch.Generator | None], sampling_rows: list[bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each expanded row with a draft x (``drafts >= 0``): whether x is accepted
    (u < p(x), u ~ U[0, 1)) and the residual distribution p with x removed (unnormalised:
    the exponential race that samples from it is scale-free). Rows without a draft keep
    p and are never "accepted". A seeded row draws u from its own generator."""
    has_draft = drafts >= 0
    index = drafts.clamp(min=0).unsqueeze(1)
    draft_probs = probs.gather(1, index).squeeze(1)
    uniforms = torch.rand(drafts.shape, device=probs.device)
    for row, generator in enumerate(generators):
        if generator is not None and sampling_rows[row]:
            uniforms[row] = torch.rand((), generator=generator, device=probs.device)
    residual = torch.where(has_draft.unsqueeze(1), probs.scatter(1, index, 0.0), probs)
    # A draft holding all the mass (the rest underflowed) leaves nothing to resample.
    accepted = has_draft & ((uniforms < draft_probs) | (residual.sum(dim=1) <= 0))
    return accepted, residual
