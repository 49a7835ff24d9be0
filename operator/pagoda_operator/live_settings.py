"""Engine settings the tuner changes in running engines, and how pods still start tuned.

A running engine takes ``maxNumSeqs`` and ``gpuMemoryUtilization`` live, through its admin
API (``pagoda serve --admin-port``, behind a key of its own). The tuner sets them there pod
by pod (``tuning.live``), so a change costs a step or a CUDA-graph capture instead of a
rolling restart. What a pod starts with must still be the tuned value, or a restarted pod
would run the old one: so where tuning is Auto the Deployment does not carry those values
in its pod template, which would roll every engine on each change, but refers to them:

- the engine's flags read ``$(PAGODA_MAX_NUM_SEQS)`` and ``$(PAGODA_GPU_MEMORY_UTILIZATION)``,
  which the kubelet expands from the container's environment ("Variable references
  $(VAR_NAME) are expanded using the container's environment", the Container API's
  ``args``), filled from the ConfigMap ``<name>-engine-settings``; a container reads it when
  it starts, so a changed value restarts nothing and every later start takes it;
- the ConfigMap holds the values in force (the spec with the tuner's overrides), written
  with the rest of the owned objects;
- a change the engines cannot take live (a tensor-parallel engine's larger batch) still
  has to restart them: the pod template carries the hash of every value not applied live,
  ``pagoda.dev/engine-settings``, so such a change (or the user's own edit of the spec)
  rolls the engines as before, and one applied live does not;
- the admin key comes from the Secret ``<name>-engine-admin``, which the operator creates
  once with a random key and owns (deleted with the LLMDeployment), and which only the
  engine pods mount; the admin port is declared on the pod, and no Service routes to it.

LoRA adapters follow the same pattern (``adapters``, ``adapter_sync``): the operator loads
and unloads them through the admin API, and the ConfigMap's ``loraModules`` is the list a
starting engine serves (``--lora-modules $(PAGODA_LORA_MODULES)``). So the admin API, its
Secret and the ConfigMap are there where tuning is Auto or LoRA is on; the knobs' references
and the restart hash only where tuning is Auto.

Pure: plain dicts in, plain dicts out.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pagoda_operator.adapters import (
    LORA_MODULES_ENV,
    LORA_MODULES_KEY,
    lora_enabled,
    lora_modules_value,
)
from pagoda_operator.overrides import (
    GPU_MEMORY_UTILIZATION,
    MAX_NUM_SEQS,
    recorded_overrides,
    why_inactive,
)
from pagoda_operator.spec import with_defaults

ADMIN_PORT = 8001
ADMIN_PORT_NAME = "admin"
ADMIN_KEY_ENV = "PAGODA_ADMIN_API_KEY"
ADMIN_SECRET_KEY = "admin-api-key"
SETTINGS_ANNOTATION = "pagoda.dev/engine-settings"
# knob -> (the engine's flag, the environment variable the flag reads)
# (in the order the command line has always had them: a Deployment that does not tune keeps
# its pod template through an operator upgrade)
LIVE_KNOBS = {
    GPU_MEMORY_UTILIZATION: ("--gpu-memory-utilization", "PAGODA_GPU_MEMORY_UTILIZATION"),
    MAX_NUM_SEQS: ("--max-num-seqs", "PAGODA_MAX_NUM_SEQS"),
}
# knob -> the admin API's setting name (the engine's own)
ENGINE_SETTINGS = {MAX_NUM_SEQS: "max_num_seqs", GPU_MEMORY_UTILIZATION: "gpu_memory_utilization"}


def live_enabled(spec: dict[str, Any]) -> bool:
    """Whether this defaulted spec's engines take the tuner's changes live: they do where
    the tuner applies changes (Auto)."""
    return spec["tuning"]["mode"] == "Auto"


def admin_enabled(spec: dict[str, Any]) -> bool:
    """Whether the engines serve the admin API (and read the settings ConfigMap): for the
    tuner's live changes, or for live adapters."""
    return live_enabled(spec) or lora_enabled(spec)


def settings_config_map_name(name: str) -> str:
    return f"{name}-engine-settings"


def admin_secret_name(name: str) -> str:
    return f"{name}-engine-admin"


def knob_text(knob: str, value: float) -> str:
    return f"{float(value):g}" if knob == GPU_MEMORY_UTILIZATION else str(int(value))


def settings_data(spec: dict[str, Any]) -> dict[str, str]:
    """The ConfigMap's data: each live knob's value in force, as its flag takes it."""
    return {knob: knob_text(knob, spec["engine"][knob]) for knob in LIVE_KNOBS}


def config_map_data(spec: dict[str, Any], lora_modules: list[dict[str, str]]) -> dict[str, str]:
    """The settings ConfigMap's data: the live knobs where tuning is Auto, and where LoRA is
    on the adapters a starting engine serves (``[{name, path}]``)."""
    data = settings_data(spec) if live_enabled(spec) else {}
    if lora_enabled(spec):
        data[LORA_MODULES_KEY] = lora_modules_value(lora_modules)
    return data


def flag_arguments(spec: dict[str, Any]) -> list[str]:
    """The live knobs' flags: references to the environment where they are live, else the
    values themselves."""
    args: list[str] = []
    for knob, (flag, env) in LIVE_KNOBS.items():
        args += [flag, f"$({env})" if live_enabled(spec) else knob_text(knob, spec["engine"][knob])]
    if admin_enabled(spec):
        args += ["--admin-port", str(ADMIN_PORT)]
    return args


def env_entries(name: str, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The container's variables the live flags and the adapter list read, and the admin key."""
    config_map = settings_config_map_name(name)
    keys = [(env, knob) for knob, (_, env) in LIVE_KNOBS.items()] if live_enabled(spec) else []
    if lora_enabled(spec):
        keys.append((LORA_MODULES_ENV, LORA_MODULES_KEY))
    entries = [
        {"name": env, "valueFrom": {"configMapKeyRef": {"name": config_map, "key": key}}}
        for env, key in keys
    ]
    entries.append({"name": ADMIN_KEY_ENV, "valueFrom": {"secretKeyRef": {
        "name": admin_secret_name(name), "key": ADMIN_SECRET_KEY}}})  # fmt: skip
    return entries


def restart_hash(llmd: dict[str, Any], spec: dict[str, Any]) -> str:
    """The hash of the live knobs' values that were not applied live: a changed one must
    restart the engines (the pod template carries it), one applied live must not."""
    values = settings_data(spec)
    user_spec = with_defaults(llmd.get("spec") or {})
    for knob, override in recorded_overrides(llmd).items():
        live = knob in LIVE_KNOBS and override.get("live")
        if live and why_inactive(user_spec, knob, override) is None:
            values[knob] = knob_text(knob, user_spec["engine"][knob])
    canonical = json.dumps(values, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
