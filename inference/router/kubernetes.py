"""Engines found in Kubernetes: the ready endpoints of the LLMDeployments' Services.

The EndpointSlice controller gives a Service's EndpointSlices the Service's labels (apart
from its reserved ones: ``setEndpointSliceLabels`` in Kubernetes' staging/src/k8s.io/
endpointslice/utils.go), so the slices of every LLMDeployment's Service carry
``app.kubernetes.io/name=pagoda-engine`` (the operator's engine label; an endpoint picker's
Service has another name label). Each ready endpoint on the port named ``http`` becomes a backend
whose models its own ``/v1/models`` tells, so one router serves every LLMDeployment of the
namespace, adapters included, with no list to keep. The LLMDeployments themselves say which
models the namespace serves even while one has no engine (scaled to zero), so a request for
it is held for a cold start rather than refused as unknown, also by a router that has just
started. The API is read with the pod's service account (``list`` on ``endpointslices`` and
``llmdeployments`` in the namespace).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ENGINE_SELECTOR = "app.kubernetes.io/name=pagoda-engine"
ENGINE_PORT_NAME = "http"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class KubeSource:
    """Where and how to read EndpointSlices."""

    namespace: str
    selector: str = ENGINE_SELECTOR
    api_url: str | None = None  # None: the pod's own API server (in-cluster)

    def client(self) -> httpx.AsyncClient:
        if self.api_url is not None:
            return httpx.AsyncClient(base_url=self.api_url, timeout=10)
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get(
            "KUBERNETES_SERVICE_PORT", "443"
        )
        if not host:
            raise ValueError(
                "--discover-namespace needs the Kubernetes API: run the router in a pod "
                "(KUBERNETES_SERVICE_HOST unset here) or give --kube-api"
            )
        token = (SERVICE_ACCOUNT / "token").read_text().strip()
        return httpx.AsyncClient(
            base_url=f"https://{host}:{port}",
            verify=str(SERVICE_ACCOUNT / "ca.crt"),
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        )


def ready_urls(slices: list[dict[str, Any]]) -> set[str]:
    """``http://address:port`` of every endpoint that is ready (a missing condition counts
    as ready, as the API documents) on the engine port."""
    urls = set()
    for endpoint_slice in slices:
        ports = [p for p in endpoint_slice.get("ports") or [] if p.get("name") == ENGINE_PORT_NAME]
        if not ports or ports[0].get("port") is None:
            continue
        for endpoint in endpoint_slice.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            for address in (endpoint.get("addresses") or [])[:1]:
                host = f"[{address}]" if ":" in address else address
                urls.add(f"http://{host}:{ports[0]['port']}")
    return urls


async def engine_urls(client: httpx.AsyncClient, source: KubeSource) -> set[str]:
    path = f"/apis/discovery.k8s.io/v1/namespaces/{source.namespace}/endpointslices"
    response = await client.get(path, params={"labelSelector": source.selector})
    response.raise_for_status()
    return ready_urls(response.json().get("items") or [])


LLMDEPLOYMENTS = "/apis/pagoda.dev/v1alpha1/namespaces/{namespace}/llmdeployments"


async def deployed_models(client: httpx.AsyncClient, source: KubeSource) -> set[str]:
    """``status.modelName`` of every LLMDeployment in the namespace (what its engines serve,
    as the operator writes it)."""
    response = await client.get(LLMDEPLOYMENTS.format(namespace=source.namespace))
    response.raise_for_status()
    items = response.json().get("items") or []
    return {str(m) for item in items if (m := (item.get("status") or {}).get("modelName"))}
