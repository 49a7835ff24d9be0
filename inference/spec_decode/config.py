"""``speculative_config`` as vLLM spells it, parsed into one checked, frozen object.

``--speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4, "prompt_lookup_min": 2}'`` (or the same dict in
``LLM(speculative_config=...)``), or ``{"method": "draft_model", "model": PATH,
"num_speculative_tokens": 4}`` (a smaller model sharing the target's tokenizer), or
``{"method": "eagle", "model": PATH, "num_speculative_tokens": 3}`` (an EAGLE-1/2 head fed
the target's hidden states, ``inference.spec_decode.eagle``), or ``"method": "eagle3"`` (an
EAGLE-3 head, fed three of the target's layers). The other methods vLLM knows (MTP,
Medusa, ...) are refused by name, so a vLLM command line fails with a sentence instead of
running without the heads it asked for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SUPPORTED_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# The methods whose proposer is a model with its own KV cache (the rest: n-gram lookup).
MODEL_METHODS = ("draft_model", "eagle", "eagle3")
# Known to vLLM, not built here (yet).
UNBUILT_METHODS = ("mtp", "medusa", "mlp_speculator", "suffix")
# Above this many running sequences a step does not speculate: verifying k drafts per row
# multiplies the step's tokens by up to k + 1, which pays at small batches (memory-bound
# decode) and costs at large ones (compute-bound). Conservative until measured on the
# H200; vLLM's key for the same rule.
DEFAULT_DISABLE_BY_BATCH_SIZE = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 0  # n-gram only
    prompt_lookup_min: int = 0
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    # draft_model: the draft's folder (or hub id), as the target's; eagle: the head's.
    model: str | None = None

    def summary(self) -> str:
        how = (f"n-gram {self.prompt_lookup_min}..{self.prompt_lookup_max}"
               if self.method == "ngram" else f"{self.method} {self.model}")
        return (f"{self.method}: k={self.num_speculative_tokens}, {how}, off above batch "
                f"{self.disable_by_batch_size}")


_COMMON_KEYS = ("method", "num_speculative_tokens", "disable_by_batch_size")
_KEYS = {
    "ngram": (*_COMMON_KEYS, "prompt_lookup_max", "prompt_lookup_min"),
    # draft_tensor_parallel_size: vLLM's key; only 1 (the draft runs beside the target).
    "draft_model": (*_COMMON_KEYS, "model", "draft_tensor_parallel_size"),
    "eagle": (*_COMMON_KEYS, "model", "draft_tensor_parallel_size"),
    "eagle3": (*_COMMON_KEYS, "model", "draft_tensor_parallel_size"),
}


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
    method = _method(value)
    given = set(value)
    if value.get("model") in ("ngram", "[ngram]"):
        given.discard("model")  # vLLM's old spelling of the method, not a model
    unknown = sorted(given - set(_KEYS[method]))
    if unknown:
        raise ValueError(f"speculative_config keys {unknown} are not supported for "
                         f"method {method!r}; known: {list(_KEYS[method])}")
    k = _positive_int(value, "num_speculative_tokens", None)
    batch = _positive_int(value, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
    if method in MODEL_METHODS:
        return SpeculativeConfig(method, k, disable_by_batch_size=batch,
                                 model=_draft_model(method, value))
    # As vLLM: one bound given stands for both; neither, 5.
    lookup_min = value.get("prompt_lookup_min", value.get("prompt_lookup_max", 5))
    lookup_max = value.get("prompt_lookup_max", lookup_min)
    lookup_min = _positive_int({"prompt_lookup_min": lookup_min}, "prompt_lookup_min", None)
    lookup_max = _positive_int({"prompt_lookup_max": lookup_max}, "prompt_lookup_max", None)
    if lookup_min > lookup_max:
        raise ValueError(f"speculative_config prompt_lookup_min ({lookup_min}) exceeds "
                         f"prompt_lookup_max ({lookup_max})")
    return SpeculativeConfig(method, k, lookup_max, lookup_min, batch)


def _method(value: dict[str, Any]) -> str:
    """The method asked for. As vLLM's ``SpeculativeConfig``: without a method, a
    ``model`` of "ngram" means n-gram lookup and any other model a draft model."""
    method = value.get("method")
    model = value.get("model")
    if method is None and isinstance(model, str):
        method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
        if method == "draft_model" and "eagle" in model.lower():
            # vLLM reads an EAGLE head from its name the same way
            method = "eagle3" if "eagle3" in model.lower() else "eagle"
    if method in UNBUILT_METHODS:
        raise ValueError(f"speculative_config method {method!r} is not supported yet; "
                         f"supported: {list(SUPPORTED_METHODS)}")
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"speculative_config needs a method, one of "
                         f"{list(SUPPORTED_METHODS)}; got {method!r}")
    return method


def _draft_model(method: str, value: dict[str, Any]) -> str:
    model = value.get("model")
    if not isinstance(model, str) or not model:
        what = ("the EAGLE head's folder (or hub id), trained for the target" if method in
                ("eagle", "eagle3") else "the draft model's folder (or hub id), sharing the "
                "target's tokenizer")  # fmt: skip
        raise ValueError(f"speculative_config method {method!r} needs model: {what}")
    draft_tp = value.get("draft_tensor_parallel_size", 1)
    if draft_tp != 1:
        raise ValueError(f"speculative_config draft_tensor_parallel_size={draft_tp!r} is not "
                         f"supported: the {method} proposer runs on the target's one GPU (1)")
    return model


def _positive_int(value: dict[str, Any], key: str, default: int | None) -> int:
    number = value.get(key, default)
    if number is None:
        raise ValueError(f"speculative_config needs {key} (a positive integer)")
    if not isinstance(number, int) or isinstance(number, bool) or number < 1:
        raise ValueError(f"speculative_config {key} must be a positive integer, got "
                         f"{number!r}")
    return number
