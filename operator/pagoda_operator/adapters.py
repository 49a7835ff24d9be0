"""LoRA adapters of an LLMDeployment (``spec.adapters``): where each lives, and its flags.

An adapter is a ``{name, uri}`` pair. ``hf://`` and ``s3://`` adapters are delivered like the
model: the loader Job downloads each, with the same ``pagoda download`` CLI, into a folder of
its own under ``adapters/`` on the model cache volume, named after the adapter's name and a
digest of its source, so a changed uri is a new folder (never a mix of two versions). The
engines mount ``adapters/`` read-only at ``/adapters``. An absolute path is a folder already
in the engine container (baked into the image, or under one of ``spec.volumeMounts``).

The engine gets ``--enable-lora`` and the limits of ``spec.engine.lora`` on its command line,
and its adapter list from the environment: ``--lora-modules $(PAGODA_LORA_MODULES)``, a JSON
list the kubelet expands from the settings ConfigMap (``live_settings``) when the container
starts. So adding, removing or changing an adapter changes no pod template and restarts no
engine: once the loader has put it in the cache, the operator loads it into every Ready
engine through the admin API (``adapter_sync``), and a pod that starts later reads the
current list. Only what the engines cannot change live rolls them: turning LoRA on or off
(the first adapter without ``spec.engine.lora``, or the last one's removal), the limits, and
the first downloaded adapter of a deployment whose model is not downloaded (a volume more).
The limits therefore do not follow the number of adapters: unset, ``maxLoras`` is 8 (at most
``maxCpuLoras``) and ``maxCpuLoras`` is the most adapters a spec may list.

Everything here is pure: spec in, paths, flags or problems out.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

DOWNLOAD_SCHEMES = ("hf", "s3")
# On the cache volume, and in the engine container.
ADAPTERS_FOLDER = "adapters"
ADAPTERS_MOUNT_PATH = "/adapters"
ADAPTER_VOLUME = "adapter-cache"
# Set on each adapter's loader container, so a failure can name the adapter.
ADAPTER_NAME_ENV = "PAGODA_ADAPTER"
# The engine's own --max-loras default is 1: a deployment with several adapters would then
# run one adapter per step. Unset, this many slots (device memory allocated at start-up).
DEFAULT_MAX_LORAS = 8
MAX_ADAPTERS = 32
# The container variable --lora-modules reads, and its key in the settings ConfigMap.
LORA_MODULES_ENV = "PAGODA_LORA_MODULES"
LORA_MODULES_KEY = "loraModules"
# The engine's --max-lora-rank default (tests/test_settings_contract.py keeps them equal).
ENGINE_DEFAULT_MAX_LORA_RANK = 16
# A vLLM model name the engine's `name=path` flag and the routes carry: no '/' (read as a
# path by clients and gateways) and no '=' (the flag's separator).
NAME_PATTERN = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
HF_URI = re.compile(r"^hf://[^/@]+/[^/@]+(@.+)?$")
S3_URI = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,62}(/.*)?$")
# Flags set from spec.adapters and spec.engine.lora (refused in extraArgs alongside them).
LORA_FLAGS = ("--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank",
              "--max-cpu-loras")  # fmt: skip


def spec_adapters(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(spec.get("adapters") or [])


def lora_enabled(spec: dict[str, Any]) -> bool:
    """Whether the engines run with LoRA: with adapters, or ``spec.engine.lora`` given (which
    keeps it on with none, so the first adapter restarts nothing either)."""
    return bool(spec_adapters(spec)) or (spec.get("engine") or {}).get("lora") is not None


def is_downloaded(adapter: dict[str, Any]) -> bool:
    return str(adapter.get("uri") or "").split("://", 1)[0] in DOWNLOAD_SCHEMES


def downloaded_adapters(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The adapters the loader Job fetches into the cache."""
    return [adapter for adapter in spec_adapters(spec) if is_downloaded(adapter)]


def adapter_folder(adapter: dict[str, Any]) -> str:
    """The adapter's folder under ``adapters/``: its name, and a digest of where it comes
    from (a changed uri or endpoint is a new download, not an overwrite of a served one)."""
    identity = json.dumps([adapter["name"], adapter["uri"], adapter.get("endpoint")])
    digest = hashlib.sha256(identity.encode()).hexdigest()[:10]
    return f"{adapter['name']}-{digest}"


def adapter_path(adapter: dict[str, Any]) -> str:
    """Where the engine reads the adapter from."""
    if is_downloaded(adapter):
        return f"{ADAPTERS_MOUNT_PATH}/{adapter_folder(adapter)}"
    return str(adapter["uri"])


def lora_limits(spec: dict[str, Any]) -> dict[str, int]:
    """``maxLoras``, ``maxCpuLoras`` and (when set) ``maxLoraRank``: the spec's, else 8 slots
    (at most maxCpuLoras: the engine wants maxCpuLoras >= maxLoras) and room in CPU memory
    for as many adapters as a spec may list. Never derived from the adapters themselves: a
    changed limit restarts the engines, an added adapter must not."""
    lora = (spec.get("engine") or {}).get("lora") or {}
    max_cpu = lora.get("maxCpuLoras")
    max_loras = int(lora.get("maxLoras") or min(DEFAULT_MAX_LORAS, int(max_cpu or MAX_ADAPTERS)))
    limits = {"maxLoras": max_loras, "maxCpuLoras": int(max_cpu or max(MAX_ADAPTERS, max_loras))}
    if lora.get("maxLoraRank") is not None:
        limits["maxLoraRank"] = int(lora["maxLoraRank"])
    return limits


def max_lora_rank(spec: dict[str, Any]) -> int:
    """The rank the engines allow: the loader checks each downloaded adapter against it."""
    rank = ((spec.get("engine") or {}).get("lora") or {}).get("maxLoraRank")
    return int(rank) if rank is not None else ENGINE_DEFAULT_MAX_LORA_RANK


def lora_args(spec: dict[str, Any]) -> list[str]:
    """The engine's LoRA flags; none without LoRA (pod templates of deployments without
    adapters stay as they were). The adapters themselves come from the environment."""
    if not lora_enabled(spec):
        return []
    limits = lora_limits(spec)
    args = ["--enable-lora", "--max-loras", str(limits["maxLoras"]),
            "--max-cpu-loras", str(limits["maxCpuLoras"])]  # fmt: skip
    if "maxLoraRank" in limits:
        args += ["--max-lora-rank", str(limits["maxLoraRank"])]
    return [*args, "--lora-modules", f"$({LORA_MODULES_ENV})"]


def lora_modules_value(modules: list[dict[str, str]]) -> str:
    """The ``--lora-modules`` value of ``[{name, path}, ...]``: one JSON list ("[]": none)."""
    return json.dumps([{"name": m["name"], "path": m["path"]} for m in modules],
                      separators=(",", ":"))  # fmt: skip


def adapter_errors(spec: dict[str, Any], served_name: str | None) -> list[str]:
    """Every reason ``spec.adapters`` and ``spec.engine.lora`` cannot be deployed."""
    adapters = spec.get("adapters")
    if adapters is None:
        adapters = []
    if not isinstance(adapters, list):
        return ["spec.adapters: must be a list of {name, uri}"]
    errors = []
    if len(adapters) > MAX_ADAPTERS:
        errors.append(f"spec.adapters: at most {MAX_ADAPTERS} adapters (got {len(adapters)})")
    seen: set[str] = set()
    for index, adapter in enumerate(adapters):
        where = f"spec.adapters[{index}]"
        name = str((adapter or {}).get("name") or "")
        if not NAME_PATTERN.match(name) or len(name) > 63:
            errors.append(f"{where}.name: letters, digits, '.', '_' and '-', at most 63, "
                          f"starting and ending with a letter or digit (got {name!r})")
        elif name in seen:
            errors.append(f"{where}.name: {name!r} is given twice")
        elif name == served_name:
            errors.append(f"{where}.name: {name!r} is the served model name")
        seen.add(name)
        errors += _adapter_uri_errors(where, adapter or {})
    lora = (spec.get("engine") or {}).get("lora") or {}
    limit_errors = _lora_limit_errors(lora)
    if not limit_errors and lora.get("maxCpuLoras") is not None and (
            len(adapters) > lora["maxCpuLoras"]):  # fmt: skip
        limit_errors.append(f"spec.adapters: {len(adapters)} adapters, more than "
                            f"spec.engine.lora.maxCpuLoras ({lora['maxCpuLoras']}) keeps in "
                            "CPU memory: raise maxCpuLoras or remove adapters")  # fmt: skip
    errors += limit_errors
    if lora_enabled(spec) and (spec.get("engine") or {}).get("speculative") is not None:
        # The engine refuses the pair at start: a crash loop, unless refused here.
        errors.append("spec.adapters: speculative decoding does not run with adapters "
                      "(drafts and verification run the base model only)")
    return errors


def _adapter_uri_errors(where: str, adapter: dict[str, Any]) -> list[str]:
    uri = str(adapter.get("uri") or "")
    if not (HF_URI.match(uri) or S3_URI.match(uri) or uri.startswith("/")):
        return [f"{where}.uri: must be hf://ORG/NAME[@REVISION], s3://BUCKET[/PREFIX] or an "
                f"absolute path (got {uri!r})"]
    if not is_downloaded(adapter) and (adapter.get("endpoint") or adapter.get("credentialsSecret")):
        return [f"{where}: endpoint and credentialsSecret go with an hf:// or s3:// uri"]
    return []


def _lora_limit_errors(lora: dict[str, Any]) -> list[str]:
    errors = []
    for field, low, high in (("maxLoras", 1, 256), ("maxLoraRank", 1, 512),
                             ("maxCpuLoras", 1, 1024)):  # fmt: skip
        value = lora.get(field)
        if value is not None and (not isinstance(value, int) or not low <= value <= high):
            errors.append(f"spec.engine.lora.{field}: must be in {low}..{high} (got {value!r})")
    max_loras, max_cpu = lora.get("maxLoras"), lora.get("maxCpuLoras")
    if not errors and max_loras is not None and max_cpu is not None and max_cpu < max_loras:
        errors.append(f"spec.engine.lora: maxCpuLoras must be >= maxLoras "
                      f"({max_cpu} < {max_loras})")
    return errors
