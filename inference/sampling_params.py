"""SamplingParams: how one request picks its tokens and when it stops.

The offline API and the HTTP API share this class; argument names follow vLLM's so that
existing clients and load tools work unchanged. Invalid values raise ``ValueError`` with a
message that names the field, before the request touches the engine.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a JSON schema, any JSON object, a regular
    expression, one of a list of strings, or a grammar (Lark, or llama.cpp's GBNF), as
    vLLM's ``StructuredOutputsParams``. Exactly one of the constraints is set. Whether a
    schema or grammar is valid is decided by the grammar engine when the request is added
    (``inference.structured_output``), which raises ``ValueError``."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON without optional whitespace between tokens: shorter outputs, and small models
    # cannot drift into runs of blank lines.
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        kinds = self.kinds()
        if len(kinds) != 1:
            found = ", ".join(kinds) if kinds else "none"
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {found}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json must be a JSON schema (object or string)")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ValueError("structured_outputs.grammar must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")

    def kinds(self) -> list[str]:
        """The constraints that are set (exactly one on a valid instance)."""
        values = {
            "json": self.json, "regex": self.regex, "choice": self.choice,
            "grammar": self.grammar, "json_object": self.json_object or None,
        }  # fmt: skip
        return [name for name, value in values.items() if value is not None]

    def key(self) -> tuple:
        """Identifies the compiled grammar: equal keys share one compilation."""
        kind = self.kinds()[0]
        value = {
            "json": self.json, "regex": self.regex, "choice": self.choice,
            "grammar": self.grammar, "json_object": True,
        }[kind]  # fmt: skip
        if not isinstance(value, str):
            value = json.dumps(value, sort_keys=True)
        return (kind, value, self.disable_any_whitespace)


class RequestOutputKind(enum.Enum):
    """What each of a request's outputs holds (vLLM's names and meanings)."""

    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top alternatives besides the sampled token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    # Added to the logits of these token ids before penalties and sampling (OpenAI's range:
    # -100 bans a token, +100 all but forces it).
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # How the engine shapes this request's outputs (inference.output_processor). LLM.generate
    # asks for FINAL_ONLY, the server's engine process for DELTA.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled by the engine: EOS and generation-config stop ids of the model.
    all_stop_token_ids: frozenset[int] = field(default_factory=frozenset, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.temperature < 0.0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int):
            raise bad("top_k", "must be an integer (0 or -1 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        # The upper limit is the engine's max_logprobs (20 unless configured).
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", "must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise bad("prompt_logprobs", "must be >= 0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if self.stop and not self.detokenize:
            raise ValueError(
                "stop strings need detokenize=True (they are matched in the output text); "
                "use stop_token_ids to stop without detokenizing"
            )
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        for token_id, bias in (self.logit_bias or {}).items():
            if not isinstance(token_id, int) or token_id < 0:
                raise bad("logit_bias", "keys must be non-negative token ids")
            if not -100.0 <= bias <= 100.0:
                raise bad("logit_bias", "values must be in [-100, 100]")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "must be a StructuredOutputsParams")
            self.structured_outputs.validate()
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "must be a RequestOutputKind")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self) -> SamplingParams:
        from copy import deepcopy

        return deepcopy(self)


def check_max_logprobs(params: SamplingParams, max_logprobs: int) -> None:
    """ValueError if the request asks for more logprobs than --max-logprobs allows."""
    if max_logprobs < 0:
        return
    for name in ("logprobs", "prompt_logprobs"):
        asked = getattr(params, name, None)
        if asked is not None and asked > max_logprobs:
            raise ValueError(
                f"{name}={asked} exceeds this server's limit of {max_logprobs} "
                "(--max-logprobs)"
            )
