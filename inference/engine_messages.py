"""What the server and the engine process say to each other, in one place.

The engine runs in a process of its own (``inference/engine_core.py``); the server's side
(``inference/async_engine.py``) talks to it through two pipes, each carrying pickled lists
of the messages below. Every message is a small frozen dataclass, so both sides name the
same fields and a type checker sees a misspelt one. This module imports neither the engine
nor torch: the server unpickles these without loading either.

A step's per-request output is one ``OutputRows``: a column per field, one entry per
completion with something new (up to ``max_num_seqs`` rows, 1024 on a GPU). Columns of
builtins pickle at a tuple's cost; a dataclass per row would cost several times that on
both sides of the pipe. Token ids only: the server makes the text (``inference/text_output.py``).

server -> engine: ``AddRequest``, ``AbortRequests``, ``StopSequences``, ``RemoveLoRA``,
``Reconfigure``, ``Shutdown``, ``FinishCounts``.
engine -> server: ``Resolved`` (model folder found), ``Ready`` (loaded and warmed up),
``StepOutputs`` (one per step), ``Heartbeat`` (after idle commands, and every second when
idle), ``AddRejected`` (a bad prompt), ``Reconfigured`` (a live change made or refused),
``Dead`` (fatal; the process exits right after).
``num_adds`` counts the ``AddRequest``s the engine has taken from that server process:
against what it has sent, it tells the process how many requests the stats cannot see yet.

With several API processes (``--api-server-count``) each has its own two pipes: its rows,
``AddRejected`` and its own ``num_adds`` go to it alone; everything else (stats, timings,
``Reconfigured``, ``Ready``, ``Dead``) goes to every one, so that each can answer
``/metrics`` and ``/health`` for the whole engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeAlias

from inference.config import ResolvedEngineConfig
from inference.lora.request import LoRARequest
from inference.outputs import Logprob, SampleLogprobs
from inference.sampling_params import SamplingParams


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
    eos_token_ids: tuple[int, ...] = ()  # end a completion unless ignore_eos
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
class StopSequences:
    """Completions a stop string ended (the server found it in their text): (request id,
    completion index, stop string). The engine finishes them as if it had found it."""

    stops: list[tuple[str, int, str]]


@dataclass(frozen=True, slots=True)
class RemoveLoRA:
    """An adapter was unloaded (``/v1/unload_lora_adapter``): it leaves its device slot."""

    lora_int_id: int


@dataclass(frozen=True, slots=True)
class Shutdown:
    """From the first API process: stop the engine. From another (``--api-server-count``):
    that process leaves; its requests still running are aborted."""


@dataclass(frozen=True, slots=True)
class FinishCounts:
    """Requests an API process saw finish, by final finish reason, when there are several
    (``--api-server-count``): the engine adds them to the timings every process gets, so
    that each one's ``/metrics`` counts every process's requests."""

    counts: dict[str, int]


@dataclass(frozen=True, slots=True)
class Reconfigure:
    """Change live settings between two steps (``inference.reconfigure``): ``changes`` maps
    setting -> value; ``dry_run`` only asks what the change would cost. Answered by one
    ``Reconfigured`` with the same ``token``."""

    token: str
    changes: dict[str, Any]
    dry_run: bool = False


Command: TypeAlias = (
    AddRequest | AbortRequests | StopSequences | RemoveLoRA | Reconfigure | Shutdown
    | FinishCounts
)


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


@dataclass(slots=True)
class OutputRows:
    """A step's new output, one row per completion that has any: the i-th entry of every
    column belongs to row i. ``logprobs`` entries carry no decoded text (the server fills
    it in); ``cumulative_logprobs`` is the completion's total through the row's last token
    (None unless asked for). Per request, once: ``prompt_tails``, the prompt's last tokens
    (the detokenizer's context), with its first row; ``prompt_logprobs`` once complete."""

    request_ids: list[str] = field(default_factory=list)
    indexes: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[SampleLogprobs | None] = field(default_factory=list)
    cumulative_logprobs: list[float | None] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    stop_reasons: list[int | str | None] = field(default_factory=list)
    prompt_tails: dict[str, list[int]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[dict[int, Logprob] | None]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.request_ids)


@dataclass(frozen=True, slots=True)
class StepOutputs:
    """One engine step: every request's new output, and the stats taken after it."""

    stats: EngineStats
    num_adds: int
    rows: OutputRows
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
