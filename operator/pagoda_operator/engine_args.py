"""The engine's command line, built from a defaulted LLMDeployment spec.

This is the operator's whole knowledge of the engine (seam 1): ``pagoda serve`` and its flags.
"""

from __future__ import annotations

import json
from typing import Any

from pagoda_operator.adapters import lora_args
from pagoda_operator.constants import EMBEDDED_MODEL, ENGINE_PORT, MODEL_MOUNT_PATH
from pagoda_operator.draft_model import draft_path
from pagoda_operator.live_settings import flag_arguments
from pagoda_operator.spec import model_source

API_KEY_ENV = "PAGODA_API_KEY"


def model_argument(spec: dict[str, Any]) -> str:
    """The MODEL positional argument: the mounted weights, a path in the image, or the default."""
    kind, source = model_source(spec)
    if kind in ("pvc", "hostPath", "download"):
        return MODEL_MOUNT_PATH
    return source.get("path") or EMBEDDED_MODEL


def served_model_name(spec: dict[str, Any]) -> str:
    model = spec.get("model") or {}
    return model.get("servedModelName") or model["name"]


def gpu_count(spec: dict[str, Any]) -> int:
    """GPUs one replica asks for: one per tensor-parallel rank, none on a CPU-only engine."""
    engine = spec["engine"]
    return 0 if engine["device"] == "cpu" else int(engine["tensorParallelSize"])


def serve_args(spec: dict[str, Any]) -> list[str]:
    """Arguments after ``pagoda``: ``serve MODEL`` and one flag per engine field that is set."""
    engine = spec["engine"]
    args = [
        "serve",
        model_argument(spec),
        "--host",
        "0.0.0.0",
        "--port",
        str(ENGINE_PORT),
        "--served-model-name",
        served_model_name(spec),
        "--tensor-parallel-size",
        str(engine["tensorParallelSize"]),
        # Where tuning is Auto, references the pod's environment fills from a ConfigMap,
        # so that the tuner's live changes restart nothing (``live_settings``).
        *flag_arguments(spec),
        "--block-size",
        str(engine["blockSize"]),
        "--dtype",
        engine["dtype"],
        "--device",
        engine["device"],
    ]
    for field, flag in (
        ("maxNumBatchedTokens", "--max-num-batched-tokens"),
        ("maxModelLen", "--max-model-len"),
        ("maxQueueLen", "--max-queue-len"),
    ):
        if engine.get(field) is not None:
            args += [flag, str(engine[field])]
    if engine.get("toolCallParser") is not None:
        # The parser only reads the output for tool_choice "auto": naming it turns that on.
        args += ["--enable-auto-tool-choice", "--tool-call-parser", engine["toolCallParser"]]
    # Only when not the default: Deployments made before the field existed keep their pod
    # template (no rollout on an operator upgrade).
    if engine.get("kvCacheDtype", "auto") != "auto":
        args += ["--kv-cache-dtype", engine["kvCacheDtype"]]
    if engine.get("quantization") is not None:
        args += ["--quantization", engine["quantization"]]
    if engine.get("speculative") is not None:
        # A downloaded draft is read from its folder in the cache (``draft_model``).
        speculative = {**engine["speculative"], "draftModel": draft_path(spec)}
        args += ["--speculative-config", speculative_config(speculative)]
    args += lora_args(spec)
    prefix_caching = engine.get("enablePrefixCaching", True)
    args.append("--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching")
    # In-flight requests finish within this after SIGTERM (the pod's preStop sleep comes first).
    args += ["--shutdown-grace-seconds", str(spec["termination"]["drainSeconds"])]
    # An apiKeySecretRef reaches the engine as the PAGODA_API_KEY environment variable
    # (desired.engine_env), never as an argument: kubelet would expand "$(VAR)" into argv,
    # readable by anyone who can list the node's processes.
    args += [str(arg) for arg in engine.get("extraArgs") or []]
    return args


# spec.engine.speculative field -> the engine's speculative_config key (vLLM's spelling).
_SPECULATIVE_KEYS = (
    ("method", "method"),
    ("numSpeculativeTokens", "num_speculative_tokens"),
    ("promptLookupMax", "prompt_lookup_max"),
    ("promptLookupMin", "prompt_lookup_min"),
    ("disableByBatchSize", "disable_by_batch_size"),
    ("draftModel", "model"),
)


def speculative_config(speculative: dict[str, Any]) -> str:
    """``--speculative-config``'s JSON: the fields set, in a fixed order (the pod template,
    and so the rollout, changes only when the spec does)."""
    config = {key: speculative[field] for field, key in _SPECULATIVE_KEYS
              if speculative.get(field) is not None}
    return json.dumps(config, separators=(",", ":"))
