"""Metadata every owned object carries: labels, the owner reference, the config hash.

Each desired object carries the hash of its own content in an annotation, so the reconciler
can tell "already as desired" from "needs an update" by comparing one string.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pagoda_operator import constants as c


def selector_labels(name: str) -> dict[str, str]:
    return {c.LABEL_NAME: c.ENGINE_APP_NAME, c.LABEL_OWNER: name}


def selector_string(name: str) -> str:
    """The pod selector in the string form the scale subresource reports."""
    return ",".join(f"{key}={value}" for key, value in sorted(selector_labels(name).items()))


def common_labels(name: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        c.LABEL_INSTANCE: name,
        c.LABEL_COMPONENT: "inference",
        c.LABEL_MANAGED_BY: c.OPERATOR_NAME,
    }


def owner_reference(llmd: dict[str, Any]) -> dict[str, Any]:
    """Makes the garbage collector delete the object together with its LLMDeployment."""
    meta = llmd["metadata"]
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def config_hash(obj: dict[str, Any]) -> str:
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def finish(
    llmd: dict[str, Any],
    api_version: str,
    kind: str,
    body: dict[str, Any],
    object_name: str = "",
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
) -> dict:
    """Wraps a spec-level body into a complete object with metadata and its config hash."""
    name = llmd["metadata"]["name"]
    obj = {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {
            "name": object_name or name,
            "namespace": llmd["metadata"]["namespace"],
            "labels": labels or common_labels(name),
            "annotations": dict(annotations or {}),
            "ownerReferences": [owner_reference(llmd)],
        },
        **body,
    }
    obj["metadata"]["annotations"][c.ANNOTATION_CONFIG_HASH] = config_hash(obj)
    return obj
