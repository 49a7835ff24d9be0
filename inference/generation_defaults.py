"""Default sampling parameters from a model's ``generation_config.json``, as vLLM applies them.

vLLM's ``--generation-config`` (default ``auto``) reads the model's Hugging Face generation
config and uses a handful of its values as the defaults of every request that leaves them
out; ``vllm`` turns that off, and a folder reads that folder's file instead.
``--override-generation-config`` (a JSON object) goes over whatever was read, also over
``vllm``. ``max_new_tokens`` becomes the default ``max_tokens`` (still capped by the room the
context leaves). Values equal to Hugging Face's own defaults are not taken from the file
(vLLM reads the file's difference from those defaults), so a file saying ``top_k: 50``
leaves top-k off, as in vLLM.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from inference.config import EngineConfig
from inference.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def _read_file(folder: Path) -> dict[str, Any]:
    path = folder / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return {k: v for k, v in data.items() if k not in _HF_DEFAULTS or _HF_DEFAULTS[k] != v}


def generation_defaults(config: EngineConfig, model_path: Path) -> dict[str, Any]:
    """SamplingParams keyword defaults (``max_tokens`` for ``max_new_tokens``); ValueError
    if the source is not a folder or a value is out of range."""
    source = config.generation_config
    if source == "vllm":
        found: dict[str, Any] = {}
    else:
        folder = Path(model_path) if source == "auto" else Path(source).expanduser()
        if not folder.is_dir():
            raise ValueError(
                f"generation_config must be auto, vllm or a folder holding "
                f"{GENERATION_CONFIG_FILE}; {source!r} is not a folder"
            )
        found = _read_file(folder)
    found.update(config.override_generation_dict())
    defaults = {key: found[key] for key in SAMPLING_KEYS if found.get(key) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"generation config defaults {defaults}: {exc}") from None
    if defaults:
        logger.warning(
            "default sampling parameters from the generation config: %s (requests that set "
            "them override these; --generation-config vllm turns them off)", defaults,
        )
    return defaults
