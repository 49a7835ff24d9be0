"""What the server and the engine process say to each other, in one place.

The engine runs in a process of its own (``inference/engine_core.py``); the server's side
(``inference/async_engine.py``) talks to it through two pipes, each carrying pickled lists
of the messages below. Every message is a small frozen dataclass, so both sides name the
same fields and a type checker sees a misspelt one. This module imports neither the engine
nor torch: the server unpickles these without loading either.

One exception, on purpose: the per-request rows inside a step (``RequestDelta`` and its
``CompletionDelta`` entries) stay plain tuples, typed by the aliases here. A step carries
one row per running request (up to ``max_num_seqs``, 1024 on a GPU), and pickling a
dataclass or a NamedTuple per row costs several times a tuple's on both sides of the pipe
(measured: about 1 ms more per step of 512 rows, against 0.2 ms for tuples). They are built
in one place (``engine_core._deltas``) and read in one place (``async_engine``).

server -> engine: ``AddRequest``, ``AbortRequests``, ``Reconfigure``, ``Shutdown``.
engine -> server: ``Resolved`` (model folder found), ``Ready`` (loaded and warmed up),
``StepOutputs`` (one per step), ``Heartbeat`` (after idle commands, and every second when
idle), ``AddRejected`` (a bad prompt), ``Reconfigured`` (a live change made or refused),
``Dead`` (fatal; the process exits right after).
``num_adds`` counts the ``AddRequest``s the engine has taken: against what the server has
sent, it tells the server how many requests the stats cannot see yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeAlias

from inference.config import ResolvedEngineConfig
from inference.lora.request import LoRARequest
from inference.outputs import Logprob, SampleLogprobs
from inference.sampling_params import SamplingParams

# (index, new_token_ids, new_text, new_logprobs, cumulative_logprob, finish_reason,
#  stop_reason): what is new in one of a request's ``n`` completions.
CompletionDelta: TypeAlias = tuple[
    int, list[int], str, SampleLogprobs | None, float | None, str | None, int | str | None
]
# (request_id, finished, completion deltas, prompt_logprobs): prompt_logprobs is None but
# once, with the first token, for requests that asked for them.
RequestDelta: TypeAlias = tuple[
    str, bool, list[CompletionDelta], list[dict[int, Logprob] | None] | None
]


@dataclass
class EngineStats:
    """The engine's counters after a step (``LLMEngine.stats``)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_total_blocks: int
    num_free_blocks: int
    num_preemptions_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    # Speculative decoding (zero when off): sequences x steps that verified drafts, the
    # drafts, the accepted ones, and the accepted ones by position (0 = first draft).
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_num_accepted_tokens_per_pos_total: tuple[int, ...] = ()
    # LoRA (vllm:lora_requests_info): adapters of the running and the waiting sequences,
    # and the slots (0: LoRA is off).
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0


@dataclass
class EngineInfo:
    """What the server needs to know about the loaded engine (no torch objects)."""

    config: ResolvedEngineConfig
    model_name: str
    tokenizer_path: str | None
    vocab_size: int | None
    num_total_blocks: int | None
    dtype: str
    device: str
    kv_cache_dtype: str = ""  # resolved: the model's dtype or float8_e4m3fn
    startup_phases: dict[str, float] = field(default_factory=dict)
    pid: int = 0
    # SamplingParams defaults from --generation-config (max_tokens for max_new_tokens)
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = field(default=None, repr=False)  # set in the server process

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["tokenizer"] = None
        return state


@dataclass
class StepTimings:
    """Per-request latencies (seconds) and sizes completed since the last message. A
    finished request (aborted ones included, as vLLM counts them) adds one value to each of
    ``e2e``, ``queue`` ... ``generation_tokens``; vLLM's phases: queue (arrival to first
    scheduled), prefill (to first token), decode (first to last token), inference
    (first scheduled to last token)."""

    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    queue: list[float] = field(default_factory=list)
    prefill: list[float] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)
    inference: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    generation_tokens: list[int] = field(default_factory=list)
    iteration_tokens: list[int] = field(default_factory=list)  # tokens run, per step
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> count

    def __bool__(self) -> bool:
        return bool(self.ttft or self.itl or self.e2e or self.iteration_tokens or self.finished)


# ----- server -> engine ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequest:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    lora_request: LoRARequest | None = None


@dataclass(frozen=True, slots=True)
class AbortRequests:
    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class RemoveLoRA:
    """An adapter was unloaded (``/v1/unload_lora_adapter``): it leaves its device slot."""

    lora_int_id: int


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


@dataclass(frozen=True, slots=True)
class Reconfigure:
    """Change live settings between two steps (``inference.reconfigure``): ``changes`` maps
    setting -> value; ``dry_run`` only asks what the change would cost. Answered by one
    ``Reconfigured`` with the same ``token``."""

    token: str
    changes: dict[str, Any]
    dry_run: bool = False


Command: TypeAlias = AddRequest | AbortRequests | RemoveLoRA | Reconfigure | Shutdown


# ----- engine -> server ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Resolved:
    """The model folder is found (the server loads the tokenizer while weights load)."""

    tokenizer_path: str


@dataclass(frozen=True, slots=True)
class Ready:
    info: EngineInfo
    stats: EngineStats
    num_adds: int


@dataclass(frozen=True, slots=True)
class StepOutputs:
    """One engine step: every request's new output, and the stats taken after it."""

    stats: EngineStats
    num_adds: int
    outputs: list[RequestDelta]
    timings: StepTimings | None


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Sent after commands that left the engine idle, and every second while idle: the
    server's sign of life."""

    stats: EngineStats
    num_adds: int
    timings: StepTimings | None


@dataclass(frozen=True, slots=True)
class AddRejected:
    """An ``AddRequest`` the engine refused (a bad prompt); ``type_name`` names the error."""

    request_id: str
    type_name: str
    message: str


@dataclass(frozen=True, slots=True)
class Dead:
    reason: str


@dataclass(frozen=True, slots=True)
class Reconfigured:
    """The answer to a ``Reconfigure``: ``status`` 200 (applied, or planned for a dry run),
    422 (a value the engine cannot run) or 409 (one it cannot take live), with why;
    ``settings`` the live values afterwards, ``plan`` what the change did or would do,
    ``costs`` what changing each setting costs from here, ``seconds`` how long applying
    took, ``config`` and ``num_total_blocks`` the engine's own after a change."""

    token: str
    status: int
    message: str
    settings: dict[str, Any]
    plan: dict[str, Any] | None = None
    costs: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    config: ResolvedEngineConfig | None = None
    num_total_blocks: int | None = None


Message: TypeAlias = (
    Resolved | Ready | StepOutputs | Heartbeat | AddRejected | Reconfigured | Dead
)
