"""A small async client for the few Kubernetes API calls the operator makes.

kopf watches and patches the LLMDeployments itself; this client covers the rest (the owned
objects and the status subresource) with the same credentials kopf logged in with, so the
operator carries no second Kubernetes library.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from typing import Any

import aiohttp
import kopf

from pagoda_operator import __version__
from pagoda_operator import constants as c

# Plural names of the kinds the operator reads or writes.
PLURALS: dict[tuple[str, str], str] = {
    ("apps/v1", "Deployment"): "deployments",
    ("v1", "Service"): "services",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaims",
    ("v1", "Pod"): "pods",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Secret"): "secrets",
    ("batch/v1", "Job"): "jobs",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscalers",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitors",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobjects",
    ("keda.sh/v1alpha1", "TriggerAuthentication"): "triggerauthentications",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepools",
    (c.API_VERSION, c.KIND): c.PLURAL,
}

USER_AGENT = f"{c.OPERATOR_NAME}/{__version__}"
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"  # JSON is valid YAML
MERGE_PATCH_CONTENT_TYPE = "application/merge-patch+json"


class KubeError(Exception):
    """An API call that failed with an HTTP status, carrying the server's message."""

    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status
        self.message = message

    @property
    def retryable(self) -> bool:
        """Conflicts, throttling and server-side trouble pass; other 4xx need a new spec."""
        return self.status in (409, 429) or self.status >= 500


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{namespace}/{PLURALS[(api_version, kind)]}"


def object_path(api_version: str, kind: str, namespace: str, name: str) -> str:
    return f"{collection_path(api_version, kind, namespace)}/{name}"


def path_of(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    return object_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])


class KubeClient:
    """Holds one aiohttp session; logs in again once when the server answers 401."""

    def __init__(self, login: Callable[[], kopf.ConnectionInfo]) -> None:
        self._login = login
        self._info: kopf.ConnectionInfo | None = None
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _ensure_session(self, refresh: bool = False) -> aiohttp.ClientSession:
        if self._session is None or refresh:
            await self.close()
            self._info = self._login()
            ssl_context = (
                self._info.as_ssl_context() if self._info.server.startswith("https") else None
            )
            self._session = aiohttp.ClientSession(
                base_url=self._info.server.rstrip("/") + "/",
                headers={**self._info.as_http_headers(), "User-Agent": USER_AGENT},
                connector=aiohttp.TCPConnector(ssl=ssl_context if ssl_context else False),
                timeout=aiohttp.ClientTimeout(total=30),
            )
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        params: dict[str, str] | None = None,
    ) -> dict[str, Any] | None:
        """The decoded response; None for 404; KubeError for any other failure."""
        data = None if body is None else json.dumps(body)
        for attempt in (1, 2):
            session = await self._ensure_session(refresh=attempt == 2)
            async with session.request(
                method,
                path.lstrip("/"),
                data=data,
                params=params,
                headers={"Content-Type": content_type} if data is not None else None,
            ) as response:
                if response.status == 401 and attempt == 1:
                    continue
                if response.status == 404:
                    return None
                text = await response.text()
                if response.status >= 400:
                    raise KubeError(response.status, method, path, _server_message(text))
                return json.loads(text) if text else {}
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def get(self, path: str) -> dict[str, Any] | None:
        return await self.request("GET", path)

    async def list(self, path: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        """Objects of a collection carrying every label in ``labels`` (selected by the server,
        checked again here)."""
        selector = ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
        found = await self.request("GET", path, params={"labelSelector": selector})
        return [
            item
            for item in (found or {}).get("items") or []
            if all(
                ((item.get("metadata") or {}).get("labels") or {}).get(key) == value
                for key, value in labels.items()
            )
        ]

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply as the operator's field manager; creates when absent."""
        params = {"fieldManager": c.FIELD_MANAGER, "force": "true"}
        applied = await self.request(
            "PATCH", path_of(obj), body=obj, content_type=APPLY_CONTENT_TYPE, params=params
        )
        if applied is None:
            # A real API server creates on apply; simpler servers answer 404 instead.
            meta = obj["metadata"]
            collection = collection_path(obj["apiVersion"], obj["kind"], meta["namespace"])
            applied = await self.request("POST", collection, body=obj)
        return applied or {}

    async def patch_status(
        self, path: str, status: dict[str, Any], *, resource_version: str | None = None
    ) -> dict[str, Any] | None:
        """A merge patch of the status; with ``resource_version``, only if the object is still
        at that version (else KubeError 409, as for any write from a stale read)."""
        body: dict[str, Any] = {"status": status}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        return await self.request(
            "PATCH", f"{path}/status", body=body, content_type=MERGE_PATCH_CONTENT_TYPE
        )

    async def delete(self, path: str) -> bool:
        """True when something was deleted, False when it was already gone."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        return await self.request("DELETE", path, body=body) is not None

    async def post_event(
        self, obj: dict[str, Any], event_type: str, reason: str, message: str
    ) -> None:
        """An Event about ``obj``, as kopf.event posts it, for code that runs outside kopf's
        handlers (where kopf.event has no queue to post to)."""
        meta = obj["metadata"]
        now = datetime.datetime.now(tz=datetime.UTC).isoformat()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"namespace": meta["namespace"], "generateName": f"{c.OPERATOR_NAME}-"},
            "type": event_type,
            "reason": reason,
            "message": message[:1000],
            "action": reason,
            "reportingComponent": c.OPERATOR_NAME,
            "reportingInstance": c.OPERATOR_NAME,
            "source": {"component": c.OPERATOR_NAME},
            "involvedObject": {
                "apiVersion": obj.get("apiVersion", c.API_VERSION),
                "kind": obj.get("kind", c.KIND),
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "firstTimestamp": now,
            "lastTimestamp": now,
            "eventTime": now,
            "count": 1,
        }
        await self.request("POST", f"/api/v1/namespaces/{meta['namespace']}/events", body=event)

    async def resources(self, group_version: str) -> set[str] | None:
        """Names of the resources a group version serves; None when it is not served."""
        resource_list = await self.request("GET", f"/apis/{group_version}")
        if resource_list is None:
            return None
        return {str(item.get("name")) for item in resource_list.get("resources") or []}

    async def serves(self, group_version: str, plural: str) -> bool:
        """Whether the cluster serves this resource, e.g. servicemonitors of the Prometheus
        Operator, whose CRD may be installed (or removed) at any time."""
        resource_list = await self.request("GET", f"/apis/{group_version}")
        names = {item.get("name") for item in (resource_list or {}).get("resources") or []}
        return plural in names


def _server_message(text: str) -> str:
    try:
        return str(json.loads(text).get("message") or text)[:500]
    except (ValueError, AttributeError):
        return text[:500]
