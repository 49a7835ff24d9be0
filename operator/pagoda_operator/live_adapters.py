"""Adapters served live: what a starting engine serves, what each running one must load or
unload, and how the outcome reads in ``status.adapters``, the ``AdaptersReady`` condition
and the Events.

The engines' adapter list is not in their pod template (``adapters``): the operator makes
each Ready engine serve ``spec.adapters`` through its admin API (``adapter_sync``), and a
starting engine reads ``startup_adapters`` from the settings ConfigMap. That list leaves out
what would stop an engine from starting (``pagoda serve`` exits on an adapter it cannot
serve, and the pod would crash-loop): an adapter an engine refused at the same path, and a
downloaded one the loader has not delivered yet.

``status.adapters`` has one entry per adapter of the spec: ``name``, ``path`` (where the
engines read it), ``state`` (Pending: the loader has not put it in the cache yet; Loading:
not every Ready engine serves it yet, or none is Ready; Loaded: every Ready engine serves
it; Failed: an engine refused it, and ``message`` names the pod and says why)
and ``pods`` (each Ready engine's own state). An adapter removed from the spec has no entry;
its unloading from each engine is an Event.

Pure: plain dicts in, plain dicts out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagoda_operator.adapters import adapter_path, is_downloaded, spec_adapters

PENDING, LOADING, LOADED, FAILED = "Pending", "Loading", "Loaded", "Failed"
ADAPTERS_READY = "AdaptersReady"


def wanted_adapters(spec: dict[str, Any]) -> dict[str, str]:
    """Adapter name -> the path the engines read it from, in the spec's order."""
    return {adapter["name"]: adapter_path(adapter) for adapter in spec_adapters(spec)}


def recorded_adapters(llmd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``status.adapters`` by name."""
    entries = (llmd.get("status") or {}).get("adapters") or []
    return {entry["name"]: entry for entry in entries if entry.get("name")}


def startup_adapters(
    llmd: dict[str, Any], spec: dict[str, Any], *, delivered: bool
) -> list[dict[str, str]]:
    """``[{name, path}]``: the adapters an engine starting now serves from the start.

    ``delivered``: whether the model cache holds every downloaded adapter of the spec (the
    loader Job of this spec completed); until it does, a downloaded adapter is listed only
    if it was recorded at that path once delivered (Loading or Loaded)."""
    recorded = recorded_adapters(llmd)
    modules = []
    for adapter in spec_adapters(spec):
        path = adapter_path(adapter)
        before = recorded.get(adapter["name"]) or {}
        state = before.get("state") if before.get("path") == path else None
        if state == FAILED:
            continue
        if is_downloaded(adapter) and not delivered and state not in (LOADING, LOADED):
            continue
        modules.append({"name": adapter["name"], "path": path})
    return modules


@dataclass(frozen=True)
class PodPlan:
    """What one engine must do, in order: unload (removed, or moved to another path), then
    load."""

    unload: list[str]
    load: list[tuple[str, str]]  # (name, path)


def pod_plan(wanted: dict[str, str], served: dict[str, str]) -> PodPlan:
    """``served``: the engine's adapters now (name -> path), as its admin API lists them."""
    unload = [name for name, path in served.items() if wanted.get(name) != path]
    load = [(name, path) for name, path in wanted.items() if served.get(name) != path]
    return PodPlan(unload, load)


@dataclass
class PodResult:
    """One engine's answers: adapter name -> (state, message). ``unloaded``: the adapters
    removed from the spec that it served until now; ``unreachable``: why its admin API did
    not answer."""

    pod: str
    adapters: dict[str, tuple[str, str]] = field(default_factory=dict)
    unloaded: list[str] = field(default_factory=list)
    unreachable: str | None = None


@dataclass(frozen=True)
class AdapterReport:
    """What goes into the status, and the Events of what changed since the last one."""

    entries: list[dict[str, Any]]
    condition: dict[str, str]
    events: list[tuple[str, str, str]]


def adapter_report(
    llmd: dict[str, Any],
    spec: dict[str, Any],
    results: list[PodResult],
    *,
    waiting: str | None = None,
) -> AdapterReport:
    """The status entries from each Ready engine's results; ``waiting``: why no engine was
    asked (the loader Job is still delivering, the API could not be read): an adapter
    recorded at its path keeps its entry, a new one is Pending with that reason."""
    recorded = recorded_adapters(llmd)
    entries = []
    for name, path in wanted_adapters(spec).items():
        before = recorded.get(name) or {}
        if waiting is not None:
            kept = before.get("path") == path and before.get("state") != PENDING
            entries.append(before if kept else _entry(name, path, PENDING, waiting, []))
            continue
        pods = []
        for result in results:
            state, message = result.adapters.get(name) or (LOADING, result.unreachable or "")
            pods.append({"name": result.pod, "state": state,
                         **({"message": message} if message else {})})  # fmt: skip
        entries.append(_entry(name, path, *_overall(pods), pods))
    events = _events(recorded, entries, results)
    return AdapterReport(entries, _condition(entries), events)


def _entry(name: str, path: str, state: str, message: str,
           pods: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    return {"name": name, "path": path, "state": state, "message": message, "pods": pods}


def _overall(pods: list[dict[str, Any]]) -> tuple[str, str]:
    failed = [pod for pod in pods if pod["state"] == FAILED]
    if failed:
        return FAILED, "; ".join(f"pod {pod['name']} refused it: {pod.get('message', '')}"
                                 for pod in failed)  # fmt: skip
    if not pods:
        return LOADING, "no engine pod is Ready; engines that start serve it"
    pending = [pod for pod in pods if pod["state"] != LOADED]
    if pending:
        reasons = "; ".join(f"pod {pod['name']}: {pod.get('message') or 'not loaded yet'}"
                            for pod in pending)  # fmt: skip
        return (
            LOADING,
            f"loaded in {len(pods) - len(pending)} of {len(pods)} engine pods; {reasons}",
        )
    return LOADED, f"loaded in {len(pods)} engine pod{'s' if len(pods) > 1 else ''}"


def _condition(entries: list[dict[str, Any]]) -> dict[str, str]:
    failed = [e for e in entries if e["state"] == FAILED]
    if failed:
        message = "; ".join(f"adapter {e['name']}: {e['message']}" for e in failed)
        return _cond(False, "AdapterFailed", message + " (the other adapters keep serving)")
    loading = [e for e in entries if e["state"] in (PENDING, LOADING)]
    if loading:
        message = "; ".join(f"adapter {e['name']}: {e['message']}" for e in loading)
        return _cond(False, "AdaptersLoading", message)
    return _cond(True, "AdaptersLoaded",
                 f"{len(entries)} adapter(s) served by every Ready engine")  # fmt: skip


def _cond(is_true: bool, reason: str, message: str) -> dict[str, str]:
    return {"type": ADAPTERS_READY, "status": "True" if is_true else "False", "reason": reason,
            "message": message}  # fmt: skip


def _events(
    recorded: dict[str, dict[str, Any]], entries: list[dict[str, Any]], results: list[PodResult]
) -> list[tuple[str, str, str]]:
    """An Event per adapter whose state or failure changed, and per adapter unloaded."""
    events = []
    for entry in entries:
        before = recorded.get(entry["name"]) or {}
        changed = (before.get("state"), before.get("path")) != (entry["state"], entry["path"])
        if entry["state"] == LOADED and changed:
            pods = ", ".join(pod["name"] for pod in entry["pods"])
            events.append(("Normal", "AdapterLoaded", f"adapter {entry['name']} loaded live "
                                                      f"into {pods}"))  # fmt: skip
        elif entry["state"] == FAILED and (changed or before.get("message") != entry["message"]):
            events.append(("Warning", "AdapterFailed", f"adapter {entry['name']}: "
                                                       f"{entry['message']}"))  # fmt: skip
    unloaded: dict[str, list[str]] = {}
    for result in results:
        for name in result.unloaded:
            unloaded.setdefault(name, []).append(result.pod)
    for name, pods in unloaded.items():
        events.append(("Normal", "AdapterUnloaded", f"adapter {name} unloaded from "
                                                    f"{', '.join(pods)}"))  # fmt: skip
    return events
