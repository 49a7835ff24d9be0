"""The speculative draft model (``spec.engine.speculative.draftModel``): where it lives.

Methods ``draft_model``, ``eagle`` and ``eagle3`` read a second model folder: the draft, or
the EAGLE head. An absolute path is a folder already in the engine container. An ``hf://`` or
``s3://`` URI is delivered like the model: the loader Job downloads it, with the same
``pagoda download`` CLI and the same credentials handling (``draftCredentialsSecret``,
``draftEndpoint``, as ``spec.model.source``'s), into a folder of its own under ``draft/``
on the model cache volume, named after a digest of its source, so a changed URI is a new
download (never a mix of two versions). The engines mount ``draft/`` read-only at
``/draft`` and ``--speculative-config`` names the folder there. A draft is read when the
engine starts: a changed draft rolls the engines once the loader has fetched it.

Everything here is pure: spec in, paths or problems out.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from pagoda_operator.adapters import DOWNLOAD_SCHEMES, HF_URI, S3_URI

# On the cache volume, and in the engine container.
DRAFT_FOLDER = "draft"
DRAFT_MOUNT_PATH = "/draft"
# The engine's volume of the cache claim, where the model itself is not downloaded.
DRAFT_VOLUME = "draft-cache"
DRAFT_CONTAINER = "draft"
# Set on the draft's loader container, so a failure can name the draft.
DRAFT_MODEL_ENV = "PAGODA_DRAFT_MODEL"
DRAFT_METHODS = ("draft_model", "eagle", "eagle3")


def downloaded_draft(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The draft's download source (``uri``, ``endpoint``, ``credentialsSecret``, as a model
    source's) when the loader fetches it; None for a path, or no draft at all."""
    speculative = (spec.get("engine") or {}).get("speculative") or {}
    uri = str(speculative.get("draftModel") or "")
    if speculative.get("method") not in DRAFT_METHODS:
        return None
    if uri.split("://", 1)[0] not in DOWNLOAD_SCHEMES:
        return None
    source = {"uri": uri, "endpoint": speculative.get("draftEndpoint"),
              "credentialsSecret": speculative.get("draftCredentialsSecret")}  # fmt: skip
    return {key: value for key, value in source.items() if value}


def draft_folder(source: dict[str, Any]) -> str:
    """The draft's folder under ``draft/``: readable, and unique per uri and endpoint."""
    identity = json.dumps([source["uri"], source.get("endpoint")])
    digest = hashlib.sha256(identity.encode()).hexdigest()[:10]
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", source["uri"].split("://", 1)[1]).strip("_.")
    return f"{readable[:80]}-{digest}"


def draft_path(spec: dict[str, Any]) -> str | None:
    """Where the engine reads the draft from: its folder under ``/draft`` when downloaded."""
    source = downloaded_draft(spec)
    if source is not None:
        return f"{DRAFT_MOUNT_PATH}/{draft_folder(source)}"
    return ((spec.get("engine") or {}).get("speculative") or {}).get("draftModel")


def draft_model_errors(where: str, speculative: dict[str, Any]) -> list[str]:
    """Every reason the draft (``where``: the speculative block's path) cannot be delivered."""
    method, draft = speculative.get("method"), speculative.get("draftModel")
    extras = [field for field in ("draftEndpoint", "draftCredentialsSecret")
              if speculative.get(field)]  # fmt: skip
    if method not in DRAFT_METHODS:
        if draft is not None or extras:
            return [f"{where}: draftModel, draftEndpoint and draftCredentialsSecret go with "
                    "methods draft_model, eagle and eagle3"]
        return []
    if not draft:
        return [f"{where}.draftModel: required with method {method}"]
    draft = str(draft)
    if "://" in draft:
        if not (HF_URI.match(draft) or S3_URI.match(draft)):
            return [f"{where}.draftModel: must be hf://ORG/NAME[@REVISION], "
                    f"s3://BUCKET[/PREFIX] or an absolute path (got {draft!r})"]
        return []
    if not draft.startswith("/"):
        return [f"{where}.draftModel: must be hf://ORG/NAME[@REVISION], s3://BUCKET[/PREFIX] "
                f"or an absolute path in the engine container (got {draft!r})"]
    if extras:
        return [f"{where}: draftEndpoint and draftCredentialsSecret go with an hf:// or "
                "s3:// draftModel"]
    return []
