"""The model cache claim as it exists: what of the spec can still be applied to it.

Kubernetes refuses any change to a PersistentVolumeClaim's spec after creation except a
larger ``resources.requests.storage`` (and ``volumeAttributesClassName``): "spec is
immutable after creation except resources.requests and volumeAttributesClassName for bound
claims" (ValidatePersistentVolumeClaimUpdate, pkg/apis/core/validation), and a request below
the current size is "field can not be less than previous value". So the access mode, storage
class and size are decided when the claim is created; later reconciles keep the live claim's
values, and a change the spec asks for that cannot be applied is a problem for the status,
naming the field, never a rejected apply that stops the Deployment from being scaled.

Pure: the desired claim, the live claim and the spec in, the claim to apply and problems out.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from pagoda_operator import constants as c
from pagoda_operator.desired import replicas_ceiling
from pagoda_operator.metadata import config_hash

IMMUTABLE = "ImmutableField"
# Binary and decimal suffixes of Kubernetes quantities, as multiples of a byte.
_UNITS = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}  # fmt: skip


@dataclass(frozen=True)
class SettledClaim:
    claim: dict[str, Any]  # what to apply: the desired claim with the live immutable fields
    problems: list[tuple[str, str]] = field(default_factory=list)  # (reason, message)


def settle_claim(
    desired: dict[str, Any], live: dict[str, Any] | None, spec: dict[str, Any]
) -> SettledClaim:
    """The claim to apply over ``live`` (None: not created yet, the spec decides now)."""
    if live is None:
        return SettledClaim(desired)
    cache = (spec.get("model") or {}).get("cache") or {}
    claim = copy.deepcopy(desired)
    want, have = claim["spec"], live.get("spec") or {}
    name = (live.get("metadata") or {}).get("name", "the cache claim")
    problems: list[tuple[str, str]] = []
    move = f"delete the claim {name} to have it created again with the new value"
    if have.get("accessModes") and want.get("accessModes") != have["accessModes"]:
        if cache.get("accessMode"):
            problems.append((
                IMMUTABLE,
                f"spec.model.cache.accessMode is {cache['accessMode']}, the claim {name} has "
                f"{','.join(have['accessModes'])}, and access modes cannot change: {move}",
            ))  # fmt: skip
        # The mode chosen at creation stands (an automatic choice moves with the replicas).
        want["accessModes"] = list(have["accessModes"])
    if want.get("storageClassName") and want["storageClassName"] != have.get("storageClassName"):
        problems.append((
            IMMUTABLE,
            f"spec.model.cache.storageClassName is {want['storageClassName']}, the claim "
            f"{name} has {have.get('storageClassName') or 'none'}, and a claim's storage "
            f"class cannot change: {move}",
        ))  # fmt: skip
        if have.get("storageClassName"):
            want["storageClassName"] = have["storageClassName"]
        else:
            del want["storageClassName"]
    asked = want["resources"]["requests"]["storage"]
    current = ((have.get("resources") or {}).get("requests") or {}).get("storage")
    if current and _bytes(asked) < _bytes(current):
        problems.append((
            IMMUTABLE,
            f"spec.model.cache.size is {asked}, the claim {name} has {current}, and a claim "
            f"cannot shrink: {move}",
        ))  # fmt: skip
        want["resources"]["requests"]["storage"] = current
    ceiling = replicas_ceiling({"spec": spec})
    if want["accessModes"] == ["ReadWriteOnce"] and ceiling > 1:
        problems.append((
            "ReadWriteOnceShared",
            f"the claim {name} is ReadWriteOnce and up to {ceiling} replicas may run: a replica "
            "on another node than the one the volume is attached to waits with a Multi-Attach "
            "error. Set spec.model.cache.accessMode: ReadWriteMany (with a storage class that "
            "supports it) and delete the claim, or keep the replicas on one node",
        ))  # fmt: skip
    annotations = claim["metadata"]["annotations"]
    annotations.pop(c.ANNOTATION_CONFIG_HASH, None)
    annotations[c.ANNOTATION_CONFIG_HASH] = config_hash(claim)
    return SettledClaim(claim, problems)


def _bytes(quantity: str) -> float:
    text = str(quantity).strip()
    for suffix in sorted(_UNITS, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * _UNITS[suffix]
    return float(text)
