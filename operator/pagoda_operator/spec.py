"""LLMDeployment spec: defaults and the checks the operator makes before acting on it.

The API server applies the CRD's defaults and rejects what its schema and CEL rules reject;
the operator repeats the range checks here anyway, because a spec can reach it from clusters
where the CRD is older than the operator, and because some rules (flags that ``extraArgs``
must not override, GPU limits that disagree with the tensor-parallel size) need more than a
schema can say. A spec that fails here becomes a ``Degraded`` condition, never an exception.
"""

from __future__ import annotations

import copy
from typing import Any

from pagoda_operator.adapters import LORA_FLAGS, adapter_errors, lora_enabled
from pagoda_operator.constants import GPU_RESOURCE
from pagoda_operator.draft_model import DRAFT_VOLUME, draft_model_errors

TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)
BLOCK_SIZES = tuple(2**power for power in range(9))  # 1 .. 256
DTYPES = ("auto", "float16", "bfloat16", "float32")
DEVICES = ("auto", "cuda", "cpu")
# `pagoda serve --tool-call-parser` choices (the contract test keeps them the server's).
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
KV_CACHE_DTYPES = ("auto", "fp8")
# The engine's --quantization choices (tests/test_settings_contract.py keeps them equal).
QUANTIZATION_METHODS = ("fp8", "awq", "gptq", "compressed-tensors")
# The engine's speculative_config methods (tests/test_settings_contract.py keeps them equal).
SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
TUNING_MODES = ("Off", "Recommend", "Auto")
AUTOSCALER_BACKENDS = ("HPA", "KEDA")

# Flags the operator sets from typed fields; passing them again through extraArgs would
# make the Deployment disagree with the LLMDeployment it came from.
MANAGED_FLAGS = (
    "--host",
    "--port",
    "--served-model-name",
    "--tensor-parallel-size",
    "--gpu-memory-utilization",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--block-size",
    "--max-model-len",
    "--dtype",
    "--kv-cache-dtype",
    "--quantization",
    "--device",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--max-queue-len",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "--api-key",
    "--shutdown-grace-seconds",
    "--speculative-config",
)

# The engine's own defaults for maxNumSeqs, which depend on where it runs (no CRD default
# could), so that a spec without the field runs as `pagoda serve` would; the contract test
# (tests/test_settings_contract.py) keeps them equal to inference/config.py's.
ENGINE_DEFAULT_MAX_NUM_SEQS = {"cuda": 1024, "cpu": 256}

# Mirrors the `default:` values of the CRD schema (a unit test keeps the two equal).
SPEC_DEFAULTS: dict[str, Any] = {
    "replicas": 1,
    "startupTimeoutSeconds": 1800,
    "engine": {
        "tensorParallelSize": 1,
        "gpuMemoryUtilization": 0.9,
        "blockSize": 16,
        "dtype": "auto",
        "kvCacheDtype": "auto",
        "device": "auto",
        "enablePrefixCaching": True,
        "extraArgs": [],
    },
    "autoscaling": {
        "enabled": False,
        "backend": "HPA",
        "minReplicas": 1,
        "maxReplicas": 1,
        "targetRequestsWaiting": 4,
    },
    "tuning": {"mode": "Off", "cooldownSeconds": 600},
    "service": {"type": "ClusterIP"},
    "rollout": {"strategy": "RollingUpdate"},
    "termination": {
        "preStopSeconds": 10,
        "drainSeconds": 120,
        "terminationGracePeriodSeconds": 150,
    },
}


def with_defaults(spec: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``spec`` with every missing defaulted field filled in: the CRD's
    defaults, and ``engine.maxNumSeqs`` as the engine would resolve it."""
    spec = _merge_defaults(SPEC_DEFAULTS, copy.deepcopy(spec or {}))
    engine = spec["engine"]
    if engine.get("maxNumSeqs") is None:
        engine["maxNumSeqs"] = default_max_num_seqs(engine)
    return spec


def default_max_num_seqs(engine: dict[str, Any]) -> int:
    """The engine's default for this engine spec: 1024 on a GPU, 256 on CPU, and never more
    than a given ``maxNumBatchedTokens`` (a step holds at least one token per sequence)."""
    value = ENGINE_DEFAULT_MAX_NUM_SEQS["cpu" if engine.get("device") == "cpu" else "cuda"]
    batched = engine.get("maxNumBatchedTokens")
    if _is_int(batched) and batched >= 1:
        value = min(value, batched)
    return value


def _merge_defaults(defaults: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    for key, default in defaults.items():
        if key not in values or values[key] is None:
            values[key] = copy.deepcopy(default)
        elif isinstance(default, dict) and isinstance(values[key], dict):
            _merge_defaults(default, values[key])
    return values


SOURCE_KINDS = ("uri", "pvc", "hostPath", "image")
URI_SCHEMES = ("hf", "s3", "pvc")


def model_source(spec: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Where the weights are: ``download`` (hf:// or s3://, through the model cache), ``pvc``,
    ``hostPath`` or ``image``, with that kind's settings. ``pvc://claim/path`` is the pvc
    form written as a URI. No source at all means the engine's embedded model.
    """
    source = (spec.get("model") or {}).get("source") or {}
    uri = source.get("uri")
    if uri:
        scheme, _, rest = str(uri).partition("://")
        if scheme == "pvc":
            claim, _, path = rest.strip("/").partition("/")
            return "pvc", {"claimName": claim, "subPath": path, "readOnly": True}
        return "download", source
    for kind in ("pvc", "hostPath", "image"):
        if source.get(kind) is not None:
            return kind, source[kind]
    return "image", {}


def validate_spec(spec: dict[str, Any]) -> list[str]:
    """Every reason this (defaulted) spec cannot be deployed; empty when it can."""
    errors: list[str] = []
    errors += _model_errors(spec.get("model") or {})
    errors += _engine_errors(spec.get("engine") or {})
    errors += _replica_errors(spec)
    errors += _tuning_errors(spec)
    errors += _resource_errors(spec)
    errors += _rollout_errors(spec)
    model = spec.get("model") or {}
    errors += adapter_errors(spec, model.get("servedModelName") or model.get("name"))
    if lora_enabled(spec):
        errors += _extra_args_errors((spec.get("engine") or {}).get("extraArgs") or [],
                                     LORA_FLAGS, "spec.adapters and spec.engine.lora")
    return errors


def _rollout_errors(spec: dict[str, Any]) -> list[str]:
    errors = []
    rollout = spec.get("rollout") or {}
    if rollout.get("strategy") not in ("RollingUpdate", "Recreate"):
        errors.append("spec.rollout.strategy: must be RollingUpdate or Recreate")
    surge, unavailable = rollout.get("maxSurge"), rollout.get("maxUnavailable")
    if rollout.get("strategy") == "Recreate" and (surge is not None or unavailable is not None):
        errors.append(
            "spec.rollout: maxSurge and maxUnavailable go with the RollingUpdate strategy"
        )
    if surge == 0 and unavailable == 0:
        errors.append("spec.rollout: maxSurge and maxUnavailable cannot both be 0")
    termination = spec.get("termination") or {}
    pre_stop, drain = termination.get("preStopSeconds"), termination.get("drainSeconds")
    grace = termination.get("terminationGracePeriodSeconds")
    if all(_is_int(value) for value in (pre_stop, drain, grace)) and grace < pre_stop + drain:
        errors.append(
            "spec.termination: terminationGracePeriodSeconds must be >= preStopSeconds + "
            f"drainSeconds ({grace} < {pre_stop} + {drain}); the pod would be killed mid-drain"
        )
    for volume in spec.get("volumes") or []:
        if (volume or {}).get("name") in ("model", "dshm", "engine-cache", "engine-tmp",
                                          "adapter-cache", DRAFT_VOLUME):
            errors.append(f"spec.volumes: the name {volume['name']} is the operator's")
    budget = spec.get("disruptionBudget") or {}
    if budget.get("minAvailable") is not None and budget.get("maxUnavailable") is not None:
        errors.append("spec.disruptionBudget: set minAvailable or maxUnavailable, not both")
    return errors


def _model_errors(model: dict[str, Any]) -> list[str]:
    errors = []
    if not model.get("name"):
        errors.append("spec.model.name: required")
    source = model.get("source") or {}
    chosen = [kind for kind in SOURCE_KINDS if source.get(kind) is not None]
    if len(chosen) > 1:
        errors.append(
            f"spec.model.source: set only one of uri, pvc, hostPath, image (got {chosen})"
        )
    errors += _uri_errors(source)
    if source.get("pvc") is not None and not source["pvc"].get("claimName"):
        errors.append("spec.model.source.pvc.claimName: required")
    if source.get("hostPath") is not None:
        path = source["hostPath"].get("path") or ""
        if not path.startswith("/"):
            errors.append(f"spec.model.source.hostPath.path: must be absolute (got {path!r})")
    return errors


def _uri_errors(source: dict[str, Any]) -> list[str]:
    uri = source.get("uri")
    if uri is None:
        if source.get("endpoint") or source.get("credentialsSecret"):
            return [
                "spec.model.source: endpoint and credentialsSecret go with an hf:// or s3:// uri"
            ]
        return []
    scheme, separator, rest = str(uri).partition("://")
    rest = rest.strip("/")
    if not separator or scheme not in URI_SCHEMES:
        return [f"spec.model.source.uri: must start with hf://, s3:// or pvc:// (got {uri!r})"]
    if scheme == "hf" and rest.split("@", 1)[0].count("/") != 1:
        return [f"spec.model.source.uri: expected hf://ORG/NAME[@REVISION] (got {uri!r})"]
    if not rest:
        return [f"spec.model.source.uri: names no {'claim' if scheme == 'pvc' else 'bucket'}"]
    if scheme == "pvc" and (source.get("endpoint") or source.get("credentialsSecret")):
        return ["spec.model.source: endpoint and credentialsSecret go with an hf:// or s3:// uri"]
    return []


def _engine_errors(engine: dict[str, Any]) -> list[str]:
    errors = []
    tp = engine.get("tensorParallelSize")
    if tp not in TENSOR_PARALLEL_SIZES:
        errors.append(f"spec.engine.tensorParallelSize: must be one of 1, 2, 4, 8 (got {tp})")
    utilization = engine.get("gpuMemoryUtilization")
    if not _is_number(utilization) or not 0 < utilization <= 1:
        errors.append(f"spec.engine.gpuMemoryUtilization: must be in (0, 1] (got {utilization})")
    max_num_seqs = engine.get("maxNumSeqs")
    if not _is_int(max_num_seqs) or max_num_seqs < 1:
        errors.append(f"spec.engine.maxNumSeqs: must be >= 1 (got {max_num_seqs})")
    batched = engine.get("maxNumBatchedTokens")
    if batched is not None:
        if not _is_int(batched) or batched < 1:
            errors.append(f"spec.engine.maxNumBatchedTokens: must be >= 1 (got {batched})")
        elif _is_int(max_num_seqs) and batched < max_num_seqs:
            errors.append(
                f"spec.engine.maxNumBatchedTokens: must be >= maxNumSeqs "
                f"({batched} < {max_num_seqs})"
            )
    max_model_len = engine.get("maxModelLen")
    if max_model_len is not None and (not _is_int(max_model_len) or max_model_len < 1):
        errors.append(f"spec.engine.maxModelLen: must be >= 1 (got {max_model_len})")
    block_size = engine.get("blockSize")
    if block_size not in BLOCK_SIZES:
        errors.append(
            f"spec.engine.blockSize: must be a power of two no larger than 256 (got {block_size})"
        )
    if engine.get("dtype") not in DTYPES:
        errors.append(f"spec.engine.dtype: must be one of {', '.join(DTYPES)}")
    if engine.get("kvCacheDtype", "auto") not in KV_CACHE_DTYPES:
        errors.append(f"spec.engine.kvCacheDtype: must be one of {', '.join(KV_CACHE_DTYPES)}")
    quantization = engine.get("quantization")
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        errors.append(f"spec.engine.quantization: must be one of {', '.join(QUANTIZATION_METHODS)}"
                      f" (got {quantization!r})")
    if engine.get("device") not in DEVICES:
        errors.append(f"spec.engine.device: must be one of {', '.join(DEVICES)}")
    parser = engine.get("toolCallParser")
    if parser is not None and parser not in TOOL_CALL_PARSERS:
        errors.append(
            f"spec.engine.toolCallParser: must be one of {', '.join(TOOL_CALL_PARSERS)} "
            f"(got {parser!r})"
        )
    if engine.get("device") == "cpu" and tp not in (None, 1):
        errors.append("spec.engine.tensorParallelSize: device cpu runs with 1 only")
    errors += _speculative_errors(engine)
    errors += _extra_args_errors(engine.get("extraArgs") or [])
    return errors


def _speculative_errors(engine: dict[str, Any]) -> list[str]:
    speculative = engine.get("speculative")
    if speculative is None:
        return []
    where = "spec.engine.speculative"
    method = speculative.get("method")
    if method not in SPECULATIVE_METHODS:
        return [f"{where}.method: must be one of {', '.join(SPECULATIVE_METHODS)} "
                f"(got {method!r})"]
    errors = []
    k = speculative.get("numSpeculativeTokens")
    if not _is_int(k) or not 1 <= k <= 16:
        errors.append(f"{where}.numSpeculativeTokens: must be in 1..16 (got {k!r})")
    if method != "ngram" and engine.get("tensorParallelSize") not in (None, 1):
        errors.append(f"{where}: speculative decoding with tensorParallelSize > 1 runs method ngram only")
    lookup = [speculative.get("promptLookupMin"), speculative.get("promptLookupMax")]
    if method != "ngram" and any(v is not None for v in lookup):
        errors.append(f"{where}: promptLookupMin and promptLookupMax go with method ngram")
    elif None not in lookup and lookup[0] > lookup[1]:
        errors.append(f"{where}: promptLookupMin must be <= promptLookupMax")
    errors += draft_model_errors(where, speculative)
    return errors


def _extra_args_errors(
    extra_args: list[Any], flags: tuple[str, ...] = MANAGED_FLAGS, fields: str = "a typed field"
) -> list[str]:
    errors = []
    for arg in extra_args:
        flag = str(arg).split("=", 1)[0]
        if flag in flags:
            errors.append(
                f"spec.engine.extraArgs: {flag} is set by the operator from {fields}; "
                "use that instead"
            )
    return errors


def _replica_errors(spec: dict[str, Any]) -> list[str]:
    errors = []
    replicas = spec.get("replicas")
    if not _is_int(replicas) or replicas < 0:
        errors.append(f"spec.replicas: must be >= 0 (got {replicas})")
    autoscaling = spec.get("autoscaling") or {}
    low, high = autoscaling.get("minReplicas"), autoscaling.get("maxReplicas")
    if not _is_int(low) or low < 0:
        errors.append(f"spec.autoscaling.minReplicas: must be >= 0 (got {low})")
    elif low == 0 and autoscaling.get("backend") != "KEDA":
        errors.append(
            "spec.autoscaling.minReplicas: 0 needs the KEDA backend (a "
            "HorizontalPodAutoscaler does not scale to zero)"
        )
    elif _is_int(high) and low > high:
        errors.append(f"spec.autoscaling: minReplicas must be <= maxReplicas ({low} > {high})")
    backend = autoscaling.get("backend")
    if backend not in AUTOSCALER_BACKENDS:
        errors.append(f"spec.autoscaling.backend: must be HPA or KEDA (got {backend})")
    elif (
        autoscaling.get("enabled")
        and backend == "KEDA"
        and not (spec.get("prometheus") or {}).get("url")
    ):
        errors.append("spec.prometheus.url: required when spec.autoscaling.backend is KEDA")
    return errors


def _tuning_errors(spec: dict[str, Any]) -> list[str]:
    errors = []
    tuning = spec.get("tuning") or {}
    mode = tuning.get("mode")
    if mode not in TUNING_MODES:
        errors.append(f"spec.tuning.mode: must be one of {', '.join(TUNING_MODES)} (got {mode})")
    elif mode != "Off" and not (spec.get("prometheus") or {}).get("url"):
        errors.append(f"spec.prometheus.url: required when spec.tuning.mode is {mode}")
    for knob, bounds in (tuning.get("bounds") or {}).items():
        low, high = (bounds or {}).get("min"), (bounds or {}).get("max")
        if _is_number(low) and _is_number(high) and low > high:
            errors.append(f"spec.tuning.bounds.{knob}: min must be <= max ({low} > {high})")
    return errors


def _resource_errors(spec: dict[str, Any]) -> list[str]:
    limits = ((spec.get("resources") or {}).get("limits")) or {}
    if GPU_RESOURCE not in limits:
        return []
    engine = spec.get("engine") or {}
    expected = 0 if engine.get("device") == "cpu" else engine.get("tensorParallelSize")
    if str(limits[GPU_RESOURCE]) != str(expected):
        return [
            f"spec.resources.limits.{GPU_RESOURCE}: set from tensorParallelSize "
            f"(expected {expected}, got {limits[GPU_RESOURCE]}); leave it out"
        ]
    return []


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
