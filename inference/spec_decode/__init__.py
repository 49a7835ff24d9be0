"""Speculative decoding: propose draft tokens cheaply, verify them all in one forward pass.

A speculating row runs its last token plus ``k`` drafts as one multi-token query; the
sampler chooses the target's token at each of the ``k + 1`` positions and the longest
prefix of drafts the target agrees with is kept, plus the target's own next token, so
the output is the one non-speculative decoding would give (greedy: token for token;
sampling: in distribution, by rejection sampling).

- ``config``: ``speculative_config`` as vLLM spells it, parsed and checked.
- ``ngram``: the n-gram prompt-lookup proposer.
- ``draft_model``: a smaller model's greedy guesses; ``eagle``: an EAGLE head's, fed the
  target's hidden states (both with a KV cache mirroring the target's blocks).
- ``rejection``: the device side of verification (which hidden rows to score; the
  rejection sampler), used by the runner and the sampler.
- ``drafting``: the engine side (who drafts this step, acceptance tracking, counters,
  turning a verified step's samples back into per-sequence tokens).
"""
