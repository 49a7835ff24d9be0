"""vLLM ``serve`` flags that have no counterpart here, so that a vLLM command line parses.

Every flag below is accepted by ``pagoda serve``: where the value given changes nothing here
(``--pipeline-parallel-size 1``, ``--language-model-only``) the server logs why and starts;
otherwise it refuses to start and says why, instead of argparse's "unrecognized
arguments". The engine's own vLLM settings that do not apply (``--trust-remote-code``,
``--swap-space``, ...) are declared with the rest of the engine settings, in
``inference.config``.

vLLM also accepts ``--max_num_seqs`` for ``--max-num-seqs``; ``normalize_flag_spelling``
does the same for every flag.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

IGNORED_DEST, REFUSED_DEST = "vllm_ignored", "vllm_refused"


@dataclass(frozen=True)
class ForeignFlag:
    names: tuple[str, ...]
    reason: str  # what pagoda does instead
    nargs: Any = None  # None: one value; 0: a switch; "+": several
    harmless: tuple[str, ...] | None = ()  # values that change nothing (None: every value)


FOREIGN_FLAGS = (
    ForeignFlag(("--pipeline-parallel-size", "-pp"), "pagoda shards a model over GPUs with "
                "--tensor-parallel-size only (no pipeline parallelism)", harmless=("1",)),
    ForeignFlag(("--data-parallel-size", "-dp"), "one engine per server: run more replicas "
                "(the LLMDeployment's replicas) for data parallelism", harmless=("1",)),
    ForeignFlag(("--distributed-executor-backend",), "tensor-parallel workers are local "
                "processes (mp)", harmless=("mp",)),
    ForeignFlag(("--tokenizer-mode",), "the tokenizer is the folder's Hugging Face "
                "tokenizer (auto)", harmless=("auto", "hf")),
    ForeignFlag(("--language-model-only",), "pagoda serves text-only models: no multimodal "
                "encoder is loaded", nargs=0, harmless=None),
    ForeignFlag(("--disable-custom-all-reduce",), "tensor parallelism uses NCCL's "
                "all-reduce", nargs=0, harmless=None),
    ForeignFlag(("--disable-frontend-multiprocessing",), "the engine always runs in its own "
                "process", nargs=0, harmless=None),
    ForeignFlag(("--max-seq-len-to-capture",), "CUDA graphs are captured per decode batch "
                "size, for every context length", harmless=None),
    ForeignFlag(("--guided-decoding-backend",), "structured outputs always use pagoda's "
                "grammar engine", harmless=None),
    ForeignFlag(("--use-v2-block-manager",), "the paged KV cache is the only block manager",
                nargs=0, harmless=None),
    ForeignFlag(("--num-scheduler-steps",), "one scheduler step per forward pass, with "
                "async scheduling overlapping host and GPU work", harmless=None),
    ForeignFlag(("--max-parallel-loading-workers",), "weights load in one pass per worker",
                harmless=None),
    ForeignFlag(("--fully-sharded-loras",), "LoRA adapters are sharded as their base layers "
                "are (B by output rows, A by input columns)", nargs=0, harmless=None),
    ForeignFlag(("--lora-dtype",), "LoRA adapters run in the model's dtype",
                harmless=("auto",)),
    ForeignFlag(("--num-speculative-tokens",), "speculative decoding is configured with "
                "--speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'"),
    ForeignFlag(("--kv-transfer-config",), "pagoda has no KV-cache connectors (LMCache, "
                "disaggregated prefill)"),
    ForeignFlag(("--cpu-offload-gb",), "weights stay on the GPU (no CPU offload)",
                harmless=("0",)),
    ForeignFlag(("--limit-mm-per-prompt",), "pagoda serves text-only models"),
    ForeignFlag(("--enable-sleep-mode",), "pagoda has no sleep mode", nargs=0),
    ForeignFlag(("--otlp-traces-endpoint",), "pagoda exports no OpenTelemetry traces "
                "(Prometheus metrics are at /metrics)"),
)


class _ForeignFlagAction(argparse.Action):
    def __init__(self, *args: Any, foreign: ForeignFlag, **kwargs: Any) -> None:
        self.foreign = foreign
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        value = " ".join(values) if isinstance(values, list) else values
        shown = f"{option_string} {value}" if value else option_string
        harmless = self.foreign.harmless
        ok = harmless is None or (value is not None and value in harmless)
        dest = IGNORED_DEST if ok else REFUSED_DEST
        items = list(getattr(namespace, dest, None) or [])
        items.append(f"{shown}: {self.foreign.reason}")
        setattr(namespace, dest, items)


def add_foreign_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM flags without a counterpart here")
    for foreign in FOREIGN_FLAGS:
        if foreign.harmless is None:
            help_text = f"accepted for vLLM compatibility, no effect: {foreign.reason}"
        elif foreign.harmless:
            allowed = " or ".join(foreign.harmless)
            help_text = f"refused unless {allowed}: {foreign.reason}"
        else:
            help_text = f"refused: {foreign.reason}"
        group.add_argument(
            *foreign.names, action=_ForeignFlagAction, foreign=foreign, nargs=foreign.nargs,
            dest=foreign.names[0].lstrip("-").replace("-", "_"), default=None,
            help=help_text,
        )
    parser.set_defaults(**{IGNORED_DEST: [], REFUSED_DEST: []})


def normalize_flag_spelling(argv: list[str]) -> list[str]:
    """``--max_num_seqs=8`` as ``--max-num-seqs=8``, as vLLM's parser reads it."""
    result = []
    for arg in argv:
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            name, sep, value = arg.partition("=")
            arg = name.replace("_", "-") + sep + value
        result.append(arg)
    return result
