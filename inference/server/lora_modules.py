"""The LoRA adapters a server offers under model names (vLLM's interface).

``--lora-modules`` takes ``name=path`` or the JSON form ``{"name": .., "path": ..,
"base_model_name": ..}``, and (pagoda's own) a JSON list of such objects in one argument, so
that a whole list can come from one environment variable (the operator's pods read theirs
from a ConfigMap, ``$(PAGODA_LORA_MODULES)``; ``[]`` is no adapter); a request's ``model`` naming an adapter runs with it, and
``/v1/models`` lists each adapter with its ``parent`` (the base model). With
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (vLLM's opt-in, off by default: loading
folders at a client's request is a privilege) ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` add and remove adapters while the server runs; the admin API
(``--admin-port``, behind its own key) serves the same two routes whatever the opt-in, for
the operator. An adapter is
checked (``inference.lora.peft.inspect_adapter``: its config and tensor shapes, no tensor
read) when it is offered, so a bad folder is refused up front rather than by the first
request that names it.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from dataclasses import dataclass
from itertools import count
from typing import Any

from inference.lora.peft import inspect_adapter
from inference.lora.request import LoRARequest
from inference.models.config import ModelConfig

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATES_ENV, "").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(text: str) -> list[LoRAModule]:
    """One ``--lora-modules`` value: ``name=path``, a JSON object or a JSON list of them
    (argparse type; ``LoRAModulesAction`` joins the values' lists)."""
    text = text.strip()
    if text.startswith(("{", "[")):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"--lora-modules: not JSON: {exc}") from None
        return [_json_module(item, text) for item in (value if isinstance(value, list)
                                                       else [value])]  # fmt: skip
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(
            f"--lora-modules: expected name=path or a JSON object, got {text!r}")
    return [LoRAModule(name, path)]


def _json_module(value: Any, text: str) -> LoRAModule:
    if not isinstance(value, dict) or not value.get("name") or not value.get("path"):
        raise argparse.ArgumentTypeError(
            f'--lora-modules: a JSON module needs "name" and "path", got {text!r}')
    unknown = set(value) - {"name", "path", "base_model_name"}
    if unknown:
        raise argparse.ArgumentTypeError(f"--lora-modules: unknown keys {sorted(unknown)}")
    return LoRAModule(str(value["name"]), str(value["path"]), value.get("base_model_name"))


class LoRAModulesAction(argparse.Action):
    """``--lora-modules`` values as one flat list of modules."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        modules = [module for value in values for module in value]
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), *modules])


class ServedAdapters:
    """Adapter name -> LoRARequest (ids handed out here, one per name and load)."""

    def __init__(
        self, base_names: list[str], model_config: ModelConfig | None = None,
        max_rank: int = 16, enabled: bool = False,
    ) -> None:  # fmt: skip
        self.base_names = base_names
        self.model_config = model_config
        self.max_rank = max_rank
        self.enabled = enabled
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = count(1)
        self._lock = threading.Lock()

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Offer an adapter; ValueError (changing nothing) for one that cannot be served."""
        if not self.enabled:
            raise ValueError("LoRA adapters need --enable-lora")
        if name in self.base_names:
            raise ValueError(f"{name!r} is the base model's name")
        if name in self.adapters:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        if self.model_config is not None:
            inspect_adapter(path, self.model_config, self.max_rank)
        with self._lock:
            request = LoRARequest(name, next(self._ids), path,
                                  base_model_name or self.base_names[0])  # fmt: skip
            self.adapters[name] = request
        return request

    def remove(self, name: str) -> LoRARequest:
        """KeyError if no adapter has that name. Requests running with it finish with it."""
        return self.adapters.pop(name)

    def listing(self) -> list[dict[str, str]]:
        """The adapters served now, as the admin API lists them."""
        return [{"name": r.lora_name, "path": r.lora_path, "base_model_name": r.base_model_name}
                for r in list(self.adapters.values())]  # fmt: skip

    def get(self, model: str | None) -> LoRARequest | None:
        return self.adapters.get(model) if model else None

    def cards(self, created: int, max_model_len: int) -> list[dict[str, Any]]:
        return [{"id": r.lora_name, "object": "model", "created": created,
                 "owned_by": "pagoda", "root": r.lora_path, "parent": r.base_model_name,
                 "max_model_len": max_model_len}
                for r in self.adapters.values()]  # fmt: skip
