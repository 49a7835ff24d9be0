"""A Kubernetes API emulator (kmock) in a background thread, plus a kubectl-like HTTP client.

kmock keeps objects in memory and serves list/watch/get/create/patch/delete. On top of it,
``ClusterEmulator`` adds what a real API server and controller manager would do and the
operator relies on: uid, generation, resourceVersion and creationTimestamp on objects,
names from generateName, cascading deletion through owner references (also of objects
created with an owner that is already gone, as the garbage collector does), and optimistic
concurrency (a write that names a resourceVersion other than the object's is a 409).
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import kmock
from kmock._internal import enums, rendering
from kmock._internal.k8s import KubernetesError

TEST_USER_AGENT = "pagoda-tests"
REQUEST_HISTORY = 200
REQUEST_TIMEOUT_S = 60


@attrs.frozen
class ResourceVersionConflictError(KubernetesError):
    status: int = 409
    reason: str = "Conflict"
    message: str = (
        "Operation cannot be fulfilled: the object has been modified; "
        "please apply your changes to the latest version and try again"
    )


@attrs.frozen
class InvalidError(KubernetesError):
    status: int = 422
    reason: str = "Invalid"
    message: str = "the object is invalid"


# What the API server refuses to change in a PersistentVolumeClaim once it exists:
# "spec: Forbidden: spec is immutable after creation except resources.requests and
# volumeAttributesClassName for bound claims" (ValidatePersistentVolumeClaimUpdate in
# kubernetes/pkg/apis/core/validation/validation.go).
CLAIM_IMMUTABLE_FIELDS = ("accessModes", "storageClassName", "volumeMode")


@attrs.define(kw_only=True)
class ClusterEmulator(kmock.KubernetesEmulator):
    # (user agent, method, path, query) of every request, in arrival order.
    calls: list[tuple[str, str, str, dict[str, str]]] = attrs.field(factory=list)
    _versions: Any = attrs.field(factory=lambda: itertools.count(1))

    async def _handle(self, request: rendering.Request):  # type: ignore[override]
        self.calls.append(
            (
                request.headers.get("User-Agent", ""),
                str(getattr(request.method, "value", request.method)),
                request.url.path,
                dict(request.params),
            )
        )
        # kmock keeps every request and matches each new one by scanning that history, so a
        # long test module gets quadratically slower; ``calls`` above is the record we keep.
        # Only requests that arrived moments ago can still be matching.
        if len(self._requests) > REQUEST_HISTORY * 2:
            del self._requests[:-REQUEST_HISTORY]
        if request.resource is not None and isinstance(request.data, dict):
            if self._stale_write(request):
                raise ResourceVersionConflictError()
            self._refuse_immutable_claim_change(request)
            self._fill_server_fields(request)
        deleted_uid = self._uid_being_deleted(request)
        response = await super()._handle(request)
        if deleted_uid is not None and response.status < 300:
            await self._collect_garbage(deleted_uid)
        if request.action == enums.action.CREATE and response.status < 300:
            await self._collect_orphan(request)
        return response

    async def _collect_orphan(self, request: rendering.Request) -> None:
        """Deletes a just-created object whose owners all no longer exist."""
        refs = (request.data.get("metadata") or {}).get("ownerReferences") or []
        if not refs:
            return
        async with self._lock:
            live = {
                (obj.raw.get("metadata") or {}).get("uid")
                for obj in self._objects.values()
                if not obj.deleted
            }
        if not any(ref.get("uid") in live for ref in refs):
            await self._collect_garbage_of(request)

    async def _collect_garbage_of(self, request: rendering.Request) -> None:
        async with self._lock:
            key = (request.resource, request.namespace, request.data["metadata"]["name"])
            if key not in self._objects or self._objects[key].deleted:
                return
            obj = self._objects[key]
            raw = obj.raw
            obj.delete()
            await self._buses[request.resource].put({"type": "DELETED", "object": raw})

    def _fill_server_fields(self, request: rendering.Request) -> None:
        meta = request.data.setdefault("metadata", {})
        meta["resourceVersion"] = str(next(self._versions))
        if request.action == enums.action.CREATE:
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("generation", 1)
            now = datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            meta.setdefault("creationTimestamp", now)
        elif request.action == enums.action.UPDATE and request.subresource is None:
            current = self._current(request)
            if current is not None and "spec" in request.data:
                if json.dumps(current.get("spec"), sort_keys=True) != json.dumps(
                    merge_patch(current.get("spec"), request.data["spec"]), sort_keys=True
                ):
                    meta["generation"] = int(current["metadata"].get("generation", 1)) + 1

    def _refuse_immutable_claim_change(self, request: rendering.Request) -> None:
        if request.action != enums.action.UPDATE or request.subresource is not None:
            return
        if getattr(request.resource, "plural", None) != "persistentvolumeclaims":
            return
        current = self._current(request)
        if current is None or "spec" not in request.data:
            return
        before = current.get("spec") or {}
        after = merge_patch(before, request.data["spec"])
        changed = [f for f in CLAIM_IMMUTABLE_FIELDS if before.get(f) != after.get(f)]
        if changed:
            raise InvalidError(
                message=f'PersistentVolumeClaim "{request.name}" is invalid: spec: Forbidden: '
                "spec is immutable after creation except resources.requests and "
                f"volumeAttributesClassName for bound claims (changed: {', '.join(changed)})"
            )

    def _stale_write(self, request: rendering.Request) -> bool:
        """A write preconditioned on a resourceVersion the object no longer has."""
        expected = (request.data.get("metadata") or {}).get("resourceVersion")
        if request.action != enums.action.UPDATE or expected is None:
            return False
        current = self._current(request)
        return current is not None and current["metadata"].get("resourceVersion") != expected

    def _current(self, request: rendering.Request) -> dict[str, Any] | None:
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            return None
        return json.loads(json.dumps(dict(self._objects[key].raw)))

    def _uid_being_deleted(self, request: rendering.Request) -> str | None:
        if request.action != enums.action.DELETE or request.name is None:
            return None
        current = self._current(request)
        return None if current is None else current["metadata"].get("uid")

    async def _collect_garbage(self, owner_uid: str) -> None:
        """Deletes every object whose owner reference points at ``owner_uid``, recursively."""
        async with self._lock:
            dependents = []
            for key, obj in list(self._objects.items()):
                if obj.deleted:
                    continue
                refs = (obj.raw.get("metadata") or {}).get("ownerReferences") or []
                if any(ref.get("uid") == owner_uid for ref in refs):
                    dependents.append((key, obj))
            for (resource, _, _), obj in dependents:
                raw = obj.raw
                obj.delete()
                await self._buses[resource].put({"type": "DELETED", "object": raw})
        for _, obj in dependents:
            uid = (obj.last.raw.get("metadata") or {}).get("uid")
            if uid:
                await self._collect_garbage(uid)


def merge_patch(current: Any, patch: Any) -> Any:
    """A JSON merge patch (RFC 7386) applied to ``current``: a null removes its key, also
    inside an object the patch adds."""
    if not isinstance(patch, dict):
        return patch
    result = dict(current) if isinstance(current, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class EmulatedCluster:
    """Runs a ClusterEmulator on 127.0.0.1 in its own thread and event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.emulator: ClusterEmulator | None = None
        self.server: kmock.Server | None = None

    def start(self) -> EmulatedCluster:
        self.thread.start()
        self._run(self._start())
        return self

    async def _start(self) -> None:
        self.emulator = ClusterEmulator()
        self.emulator.resources.load_bundled()
        self.emulator.resources["pagoda.dev/v1alpha1/llmdeployments"] = kmock.ResourceInfo(
            kind="LLMDeployment",
            singular="llmdeployment",
            namespaced=True,
            verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
            shortnames={"llmd"},
            subresources={"status", "scale"},
        )
        await self.emulator.__aenter__()
        self.server = kmock.Server(self.emulator)
        await self.server.__aenter__()

    def stop(self) -> None:
        async def _stop() -> None:
            assert self.server is not None and self.emulator is not None
            await self.server.__aexit__(None, None, None)
            await self.emulator.__aexit__(None, None, None)

        try:
            self._run(_stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    def serve_resource(self, resource: str, kind: str) -> None:
        """Makes the emulator serve a resource from now on, as installing its CRD would."""

        async def _add() -> None:
            assert self.emulator is not None
            self.emulator.resources[resource] = kmock.ResourceInfo(
                kind=kind, namespaced=True, verbs={"get", "list", "watch", "create", "patch"}
            )

        self._run(_add())

    def served_resources(self) -> set[str]:
        assert self.emulator is not None
        return set(self.emulator.resources)

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.url).rstrip("/")

    @property
    def calls(self) -> list[tuple[str, str, str, dict[str, str]]]:
        assert self.emulator is not None
        return list(self.emulator.calls)

    def write_kubeconfig(self, path: Path) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulated", "cluster": {"server": self.url}}],
            "users": [{"name": "operator", "user": {"token": "emulated-token"}}],
            "contexts": [
                {"name": "emulated", "context": {"cluster": "emulated", "user": "operator"}}
            ],
            "current-context": "emulated",
        }
        path.write_text(json.dumps(config))
        return path

    # A small kubectl over HTTP.
    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> dict[str, Any] | None:
        data = None if body is None else json.dumps(body).encode()
        headers = {"User-Agent": TEST_USER_AGENT, "Content-Type": content_type}
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            # The emulator shares this process (and a loaded CI machine's cores): be patient.
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            raise
        return json.loads(text) if text else {}

    def get(self, path: str) -> dict[str, Any] | None:
        return self.request("GET", path)

    def create(self, path: str, obj: dict[str, Any]) -> dict[str, Any] | None:
        return self.request("POST", path, obj)

    def patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any] | None:
        return self.request("PATCH", path, patch, "application/merge-patch+json")

    def delete(self, path: str) -> dict[str, Any] | None:
        return self.request("DELETE", path)

    def items(self, path: str) -> list[dict[str, Any]]:
        return list((self.get(path) or {}).get("items") or [])


def wait_for(
    probe: Callable[[], Any], *, timeout: float = 20.0, interval: float = 0.1,
    what: str | Callable[[], str] = "",
) -> Any:  # fmt: skip
    """Polls ``probe`` until it returns something truthy; fails the test after ``timeout``.
    ``what`` may be a callable, evaluated on failure (to show the state that was waited on)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    described = what() if callable(what) else what
    raise AssertionError(
        f"timed out after {timeout}s waiting for {described or probe}: last={last!r}"
    )
