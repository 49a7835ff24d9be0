"""The tuner's side of the engines' admin API: a knob change made in running engines, pod by
pod, before the pod template is touched (see ``live_settings`` for why it need not be).

Each engine pod that is Ready is sent ``POST /admin/engine-config`` on its admin port, by its
address (no Service routes there), with the key of the Secret the operator made for it. The
engine answers once the change is in effect (between two steps, after the CUDA graphs it
needs are captured: in the background while the engine serves on, or for a KV resize all of
them, stalling it) or says why it cannot take it (409: not live on this engine, e.g. a
tensor-parallel one's larger batch, or another change still under way; 422: a value it
cannot run). The first pod that refuses
or cannot be reached stops the round: the change then rolls out by restart, as before,
and the pods that took it live restart with it. The operator never imports the engine:
the admin API's setting names and answers are its whole contract (tests/test_settings_contract.py
checks them against the engine).
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pagoda_operator.kube import KubeClient, KubeError, collection_path, object_path
from pagoda_operator.live_settings import (
    ADMIN_PORT,
    ADMIN_SECRET_KEY,
    ENGINE_SETTINGS,
    admin_secret_name,
)
from pagoda_operator.metadata import owner_reference, selector_labels

ADMIN_PATH = "/admin/engine-config"
ADMIN_TIMEOUT_S = 120.0  # a change with a CUDA-graph capture takes seconds to a minute

# (url, admin key, JSON body) -> (HTTP status, JSON answer); raises OSError / aiohttp errors
# when the pod cannot be reached.
PostChange = Callable[[str, str, dict[str, Any]], Awaitable[tuple[int, dict[str, Any]]]]


@dataclass
class LiveOutcome:
    """How a live change went: ``live`` when every engine took it; otherwise ``reason``
    says why it must roll out by restart. ``pods``: one line per pod tried."""

    live: bool
    reason: str = ""
    pods: list[str] = field(default_factory=list)

    def summary(self) -> str:
        what = "applied live" if self.live else f"not live ({self.reason})"
        return f"{what}: {'; '.join(self.pods) or 'no engine pods'}"


async def ensure_admin_secret(client: KubeClient, llmd: dict[str, Any]) -> str:
    """The engines' admin key, from the Secret this LLMDeployment owns; made (a random key)
    when there is none yet. A Secret made meanwhile by another writer is read back: the
    API server refuses a second create with 409 AlreadyExists."""
    meta = llmd["metadata"]
    path = object_path("v1", "Secret", meta["namespace"], admin_secret_name(meta["name"]))
    found = await client.get(path)
    if found is None:
        body = {
            "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": admin_secret_name(meta["name"]), "namespace": meta["namespace"],
                         "ownerReferences": [owner_reference(llmd)]},
            "data": {ADMIN_SECRET_KEY: base64.b64encode(secrets.token_urlsafe(32).encode())
                     .decode()},
        }  # fmt: skip
        try:
            found = await client.request("POST", collection_path("v1", "Secret", meta["namespace"]),
                                         body=body)  # fmt: skip
        except KubeError as error:
            if error.status != 409:
                raise
            found = await client.get(path)
    encoded = ((found or {}).get("data") or {}).get(ADMIN_SECRET_KEY)
    if encoded is None:
        raise KubeError(422, "GET", path, f"the Secret has no {ADMIN_SECRET_KEY!r} key")
    return base64.b64decode(encoded).decode()


async def apply_live(
    client: KubeClient, llmd: dict[str, Any], knob: str, value: float, post: PostChange
) -> LiveOutcome:
    """``knob`` set to ``value`` in every Ready engine pod, one after the other."""
    meta = llmd["metadata"]
    if knob not in ENGINE_SETTINGS:
        return LiveOutcome(False, f"{knob} is not an engine setting")
    try:
        key = await ensure_admin_secret(client, llmd)
        pods = await client.list(collection_path("v1", "Pod", meta["namespace"]),
                                 selector_labels(meta["name"]))  # fmt: skip
    except (KubeError, aiohttp.ClientError) as error:
        return LiveOutcome(False, f"reading the admin key or the engine pods: {error}")
    ready = [pod for pod in pods if ready_address(pod)]
    if not ready:
        return LiveOutcome(False, "no engine pod is Ready")
    outcome = LiveOutcome(True)
    body = {ENGINE_SETTINGS[knob]: value}
    for pod in sorted(ready, key=lambda p: p["metadata"]["name"]):
        name = pod["metadata"]["name"]
        url = f"http://{ready_address(pod)}:{ADMIN_PORT}{ADMIN_PATH}"
        try:
            status, answer = await post(url, key, body)
        except (OSError, aiohttp.ClientError, TimeoutError) as error:
            return _refused(outcome, name, f"unreachable ({type(error).__name__}: {error})")
        if status != 200:
            message = ((answer.get("error") or {}).get("message")) or f"HTTP {status}"
            return _refused(outcome, name, f"HTTP {status}: {message}")
        seconds = answer.get("seconds", 0.0)
        plan = answer.get("plan") or {}
        capture = ((f" with {plan['background_graphs']} graphs captured in the background"
                    if plan.get("background_graphs") else " with a graph capture")
                   if plan.get("capture_needed") else "")  # fmt: skip
        outcome.pods.append(f"{name} in {seconds:.2f}s{capture}")
    return outcome


def _refused(outcome: LiveOutcome, pod: str, why: str) -> LiveOutcome:
    outcome.live, outcome.reason = False, f"{pod}: {why}"
    outcome.pods.append(f"{pod} refused")
    return outcome


def ready_address(pod: dict[str, Any]) -> str | None:
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None  # draining: it is going away, and its successor starts tuned
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or [])  # fmt: skip
    return status.get("podIP") if ready else None


async def post_change(url: str, key: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The admin API over HTTP (the engine's port is plain HTTP inside the cluster unless
    the engine serves TLS; the key is what guards it)."""
    timeout = aiohttp.ClientTimeout(total=ADMIN_TIMEOUT_S)
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(url, json=body, headers=headers) as response:
            try:
                answer = await response.json(content_type=None)
            except ValueError:
                answer = {}
            return response.status, answer if isinstance(answer, dict) else {}
