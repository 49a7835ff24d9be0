"""What to do to the owned objects: desired and existing objects in, a list of actions out."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pagoda_operator import constants as c
from pagoda_operator.gateway import POOL_API_VERSION, picker_name
from pagoda_operator.live_settings import settings_config_map_name
from pagoda_operator.model_cache import cache_claim_name, loader_job_name

# Every object an LLMDeployment may own, as (apiVersion, kind, its name for an
# LLMDeployment's name); owned objects missing from the desired set get deleted.
NameOf = Callable[[str], str]
OWNED: tuple[tuple[str, str, NameOf], ...] = (
    ("v1", "PersistentVolumeClaim", cache_claim_name),
    ("v1", "ConfigMap", settings_config_map_name),  # a tuned deployment's live settings
    ("batch/v1", "Job", loader_job_name),
    ("apps/v1", "Deployment", str),
    ("v1", "Service", str),
    ("policy/v1", "PodDisruptionBudget", str),
    ("autoscaling/v2", "HorizontalPodAutoscaler", str),
    ("monitoring.coreos.com/v1", "ServiceMonitor", str),
    ("keda.sh/v1alpha1", "TriggerAuthentication", str),
    ("keda.sh/v1alpha1", "ScaledObject", str),
    # spec.routing.gateway: the endpoint picker, then the InferencePool naming it.
    ("v1", "ServiceAccount", picker_name),
    ("rbac.authorization.k8s.io/v1", "Role", picker_name),
    ("rbac.authorization.k8s.io/v1", "RoleBinding", picker_name),
    ("v1", "ConfigMap", picker_name),
    ("apps/v1", "Deployment", picker_name),
    ("v1", "Service", picker_name),
    (POOL_API_VERSION, "InferencePool", str),
)
# Kinds whose spec cannot change in place: an update deletes and creates them again.
REPLACED_KINDS = ("Job",)

Verb = Literal["create", "update", "replace", "delete", "conflict"]
ObjectKey = tuple[str, str, str]  # (apiVersion, kind, name)


def owned_keys(name: str) -> list[ObjectKey]:
    """The key of every object the LLMDeployment ``name`` may own."""
    return [(api_version, kind, name_of(name)) for api_version, kind, name_of in OWNED]


def object_key(obj: dict[str, Any]) -> ObjectKey:
    return (obj["apiVersion"], obj["kind"], obj["metadata"]["name"])


PAST_TENSE = {"create": "Created", "update": "Updated", "replace": "Replaced", "delete": "Deleted"}


@dataclass(frozen=True)
class Action:
    verb: Verb
    api_version: str
    kind: str
    name: str
    obj: dict[str, Any] | None  # the desired object for create/update, the existing otherwise
    detail: str = ""

    @property
    def event_reason(self) -> str:
        return PAST_TENSE.get(self.verb, "NameConflict")

    @property
    def event_message(self) -> str:
        past = PAST_TENSE.get(self.verb)
        if past is None:
            return f"{self.kind} {self.name} exists and is not owned by this LLMDeployment"
        return f"{past} {self.kind} {self.name}" + (f": {self.detail}" if self.detail else "")


def is_owned_by(obj: dict[str, Any], owner_uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == owner_uid and ref.get("controller") for ref in refs)


def stored_hash(obj: dict[str, Any] | None) -> str | None:
    return ((obj or {}).get("metadata") or {}).get("annotations", {}).get(c.ANNOTATION_CONFIG_HASH)


def plan_actions(
    desired: list[dict[str, Any]],
    existing: dict[ObjectKey, dict[str, Any] | None],
    owner_uid: str,
) -> list[Action]:
    """Creates, updates and deletes that bring ``existing`` to ``desired``.

    ``existing`` maps each owned (apiVersion, kind, name) to the object found, or None.
    An object of that name that this LLMDeployment does not own is never touched: the plan
    is then the conflicts alone.
    """
    actions: list[Action] = []
    conflicts: list[Action] = []
    desired_keys = {object_key(obj) for obj in desired}
    for obj in desired:
        key = object_key(obj)
        current = existing.get(key)
        if current is None:
            actions.append(Action("create", *key, obj))
        elif not is_owned_by(current, owner_uid):
            conflicts.append(Action("conflict", *key, current))
        elif stored_hash(current) != stored_hash(obj):
            verb: Verb = "replace" if obj["kind"] in REPLACED_KINDS else "update"
            actions.append(Action(verb, *key, obj, describe_update(current, obj)))
        elif drift := drifted_paths(current, obj):
            # Edited by hand (or by another controller) since the operator applied it.
            verb = "replace" if obj["kind"] in REPLACED_KINDS else "update"
            detail = "restored " + ", ".join(drift[:5])
            actions.append(Action(verb, *key, obj, detail))
    for key, current in existing.items():
        if key not in desired_keys and current is not None and is_owned_by(current, owner_uid):
            actions.append(Action("delete", *key, current, "no longer needed"))
    return conflicts or actions


def drifted_paths(existing: dict[str, Any], desired: dict[str, Any]) -> list[str]:
    """Where the live object no longer says what the operator applied (its spec and labels;
    fields the server or other controllers add do not count)."""
    paths = changed_paths(existing.get("spec") or {}, desired.get("spec") or {}, "spec")
    labels = (desired.get("metadata") or {}).get("labels") or {}
    live_labels = (existing.get("metadata") or {}).get("labels") or {}
    paths += [
        f"metadata.labels.{key}" for key, value in labels.items() if live_labels.get(key) != value
    ]
    return paths


def describe_update(existing: dict[str, Any], desired: dict[str, Any]) -> str:
    """A short human summary of what an update changes, for the Event message."""
    old_args = _container_args(existing)
    new_args = _container_args(desired)
    parts = describe_flag_changes(old_args, new_args) if old_args != new_args else []
    other_paths = [
        path
        for path in changed_paths(existing.get("spec") or {}, desired.get("spec") or {}, "spec")
        if ".args" not in path
    ]
    parts += other_paths[:5]
    return ", ".join(parts) if parts else "spec changed"


def _container_args(obj: dict[str, Any]) -> list[str]:
    containers = (((obj.get("spec") or {}).get("template") or {}).get("spec") or {}).get(
        "containers"
    ) or []
    return list(containers[0].get("args") or []) if containers else []


def parse_flags(args: list[str]) -> dict[str, str]:
    """`--flag value` and `--flag=value` pairs; a bare `--flag` maps to the empty string."""
    flags: dict[str, str] = {}
    index = 0
    while index < len(args):
        arg = args[index]
        if arg.startswith("--"):
            if "=" in arg:
                flag, value = arg.split("=", 1)
            elif index + 1 < len(args) and not args[index + 1].startswith("--"):
                flag, value = arg, args[index + 1]
                index += 1
            else:
                flag, value = arg, ""
            flags[flag] = value
        else:
            flags[f"<arg {index}>"] = arg
        index += 1
    return flags


def describe_flag_changes(old_args: list[str], new_args: list[str]) -> list[str]:
    old, new = parse_flags(old_args), parse_flags(new_args)
    changes = []
    for flag in sorted(old.keys() | new.keys()):
        if old.get(flag) == new.get(flag):
            continue
        if flag not in old:
            changes.append(f"{flag} added" + (f" ({new[flag]})" if new[flag] else ""))
        elif flag not in new:
            changes.append(f"{flag} removed")
        else:
            changes.append(f"{flag} {old[flag]} -> {new[flag]}")
    return changes


def changed_paths(existing: Any, desired: Any, path: str) -> list[str]:
    """Paths where ``desired`` says something ``existing`` does not.

    Keys only the existing object has (server defaults, status) do not count.
    """
    if isinstance(desired, dict) and isinstance(existing, dict):
        result = []
        for key, value in desired.items():
            result += changed_paths(existing.get(key), value, f"{path}.{key}")
        return result
    if isinstance(desired, list) and isinstance(existing, list) and len(desired) == len(existing):
        result = []
        for index, (old, new) in enumerate(zip(existing, desired, strict=True)):
            result += changed_paths(old, new, f"{path}[{index}]")
        return result
    return [] if _same_scalar(existing, desired) else [path]


def _same_scalar(existing: Any, desired: Any) -> bool:
    # Quantities come back from the server as strings ("2" for 2).
    return existing == desired or (
        existing is not None and desired is not None and str(existing) == str(desired)
    )
