"""``speculative_config`` as vLLM spells it, parsed into one checked, frozen object.

``--speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4, "prompt_lookup_min": 2}'`` (or the same dict in
``LLM(speculative_config=...)``). Only the n-gram method is built; the others vLLM knows
are refused by name, so a vLLM command line fails with a sentence instead of running
without the draft model it asked for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SUPPORTED_METHODS = ("ngram",)
# Known to vLLM, not built here (yet).
UNBUILT_METHODS = ("draft_model", "eagle", "eagle3", "mtp", "medusa", "mlp_speculator",
                   "suffix")
# Above this many running sequences a step does not speculate: verifying k drafts per row
# multiplies the step's tokens by up to k + 1, which pays at small batches (memory-bound
# decode) and costs at large ones (compute-bound). Conservative until measured on the
# H200; vLLM's key for the same rule.
DEFAULT_DISABLE_BY_BATCH_SIZE = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def summary(self) -> str:
        return (f"{self.method}: k={self.num_speculative_tokens}, n-gram "
                f"{self.prompt_lookup_min}..{self.prompt_lookup_max}, off above batch "
                f"{self.disable_by_batch_size}")


_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "disable_by_batch_size")


def parse_speculative_config(value: str | dict | None) -> SpeculativeConfig | None:
    """The setting as given (JSON text or a dict; None: off) as a ``SpeculativeConfig``.
    ValueError, with what is supported, for anything else."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
    method = value.get("method")
    if method in UNBUILT_METHODS:
        raise ValueError(f"speculative_config method {method!r} is not supported yet; "
                         f"supported: {list(SUPPORTED_METHODS)}")
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"speculative_config needs a method, one of "
                         f"{list(SUPPORTED_METHODS)}; got {method!r}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(f"speculative_config keys {unknown} are not supported for "
                         f"method 'ngram'; known: {list(_KEYS)}")
    k = _positive_int(value, "num_speculative_tokens", None)
    # As vLLM: one bound given stands for both; neither, 5.
    lookup_min = value.get("prompt_lookup_min", value.get("prompt_lookup_max", 5))
    lookup_max = value.get("prompt_lookup_max", lookup_min)
    lookup_min = _positive_int({"prompt_lookup_min": lookup_min}, "prompt_lookup_min", None)
    lookup_max = _positive_int({"prompt_lookup_max": lookup_max}, "prompt_lookup_max", None)
    if lookup_min > lookup_max:
        raise ValueError(f"speculative_config prompt_lookup_min ({lookup_min}) exceeds "
                         f"prompt_lookup_max ({lookup_max})")
    batch = _positive_int(value, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
    return SpeculativeConfig(method, k, lookup_max, lookup_min, batch)


def _positive_int(value: dict[str, Any], key: str, default: int | None) -> int:
    number = value.get(key, default)
    if number is None:
        raise ValueError(f"speculative_config needs {key} (a positive integer)")
    if not isinstance(number, int) or isinstance(number, bool) or number < 1:
        raise ValueError(f"speculative_config {key} must be a positive integer, got "
                         f"{number!r}")
    return number
