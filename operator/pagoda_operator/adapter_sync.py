"""Makes every Ready engine of an LLMDeployment serve its ``spec.adapters``, live, through the
engines' admin API (``inference.server.admin``), and reports how it went (``live_adapters``).

Each Ready engine pod is asked, one after the other, on its admin port (by its address; no
Service routes there) with the key of the ``<name>-engine-admin`` Secret:
``GET /admin/lora-adapters`` (what it serves now), then ``POST /v1/unload_lora_adapter`` for
each adapter removed from the spec or moved to another path, then ``POST
/v1/load_lora_adapter`` for each one it lacks. The engine checks an adapter when it loads
it (its config and tensor shapes against the model, its rank against ``--max-lora-rank``)
and answers 400 with the reason: that adapter is Failed in that pod, and everything else
goes on. A pod that does not answer is left for the next round (its adapters stay
Loading). Nothing here raises for an engine's answer; the round runs inside the reconcile,
under the LLMDeployment's lock.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from pagoda_operator.kube import KubeClient, KubeError, collection_path
from pagoda_operator.live_adapters import (
    FAILED,
    LOADED,
    LOADING,
    AdapterReport,
    PodResult,
    adapter_report,
    pod_plan,
    wanted_adapters,
)
from pagoda_operator.live_settings import ADMIN_PORT, ADMIN_PORT_NAME
from pagoda_operator.metadata import selector_labels
from pagoda_operator.tuning.live import ensure_admin_secret, ready_address

LIST_PATH = "/admin/lora-adapters"
LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
CALL_TIMEOUT_S = 30.0  # a load reads the adapter's config and tensor header, not its tensors

# (method, url, admin key, JSON body or None) -> (HTTP status, answer: JSON, else the text);
# raises OSError / aiohttp errors when the pod cannot be reached.
AdminCall = Callable[[str, str, str, dict[str, Any] | None], Awaitable[tuple[int, Any]]]


async def sync_adapters(
    client: KubeClient,
    llmd: dict[str, Any],
    spec: dict[str, Any],
    *,
    delivered: bool,
    call: AdminCall | None = None,
) -> AdapterReport:
    """Every Ready engine brought to ``spec.adapters``; ``delivered``: whether the model cache
    holds every downloaded adapter (until then no engine is asked)."""
    if not delivered:
        return adapter_report(
            llmd,
            spec,
            [],
            waiting="waiting for the loader Job to deliver the adapters into the model cache",
        )
    meta = llmd["metadata"]
    try:
        key = await ensure_admin_secret(client, llmd)
        pods = await client.list(collection_path("v1", "Pod", meta["namespace"]),
                                 selector_labels(meta["name"]))  # fmt: skip
    except (KubeError, aiohttp.ClientError) as error:
        return adapter_report(llmd, spec, [], waiting=f"reading the admin key or the engine "
                                                      f"pods failed: {error}")  # fmt: skip
    wanted = wanted_adapters(spec)
    results = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        url = admin_url(pod)
        if url is not None:
            results.append(await sync_pod(pod["metadata"]["name"], url, key, wanted,
                                          call or admin_call))  # fmt: skip
    return adapter_report(llmd, spec, results)


async def sync_pod(pod: str, url: str, key: str, wanted: dict[str, str],
                   call: AdminCall) -> PodResult:  # fmt: skip
    result = PodResult(pod)
    try:
        status, answer = await call("GET", url + LIST_PATH, key, None)
        if status != 200 or not isinstance(answer, dict):
            result.unreachable = f"listing its adapters: {_reason(status, answer)}"
            return result
        if not answer.get("enabled"):
            result.unreachable = "it runs without --enable-lora (a pod of an older template)"
            return result
        served = {item["name"]: item["path"] for item in answer.get("adapters") or []}
        plan = pod_plan(wanted, served)
        for name in plan.unload:
            status, answer = await call("POST", url + UNLOAD_PATH, key, {"lora_name": name})
            if status not in (200, 404):  # 404: gone already
                message = f"unloading its old version: {_reason(status, answer)}"
                result.adapters[name] = (LOADING, message)
            elif name not in wanted:
                result.unloaded.append(name)
        for name, path in plan.load:
            if name in result.adapters:
                continue  # its old version is still loaded
            status, answer = await call("POST", url + LOAD_PATH, key,
                                        {"lora_name": name, "lora_path": path})  # fmt: skip
            if status == 200:
                result.adapters[name] = (LOADED, "")
            else:
                # 4xx: the engine cannot serve this adapter; else try again next round.
                state = FAILED if 400 <= status < 500 and status != 401 else LOADING
                result.adapters[name] = (state, _reason(status, answer))
    except (OSError, aiohttp.ClientError, TimeoutError) as error:
        result.unreachable = f"unreachable ({type(error).__name__}: {error})"
        return result
    for name in wanted:
        result.adapters.setdefault(name, (LOADED, ""))
    return result


def admin_url(pod: dict[str, Any]) -> str | None:
    """The Ready pod's admin API (the port its engine container declares as ``admin``);
    None for a pod that is not Ready or is going away."""
    address = ready_address(pod)
    if address is None:
        return None
    ports = [port for container in (pod.get("spec") or {}).get("containers") or []
             for port in container.get("ports") or []]  # fmt: skip
    port = next((p["containerPort"] for p in ports if p.get("name") == ADMIN_PORT_NAME),
                ADMIN_PORT)  # fmt: skip
    return f"http://{address}:{port}"


def _reason(status: int, answer: Any) -> str:
    if isinstance(answer, dict):
        message = (answer.get("error") or {}).get("message")
        if message:
            return f"HTTP {status}: {message}"
    text = answer if isinstance(answer, str) and answer else ""
    return f"HTTP {status}" + (f": {text[:300]}" if text else "")


async def admin_call(method: str, url: str, key: str,
                     body: dict[str, Any] | None) -> tuple[int, Any]:  # fmt: skip
    """The admin API over HTTP (plain inside the cluster unless the engine serves TLS; the
    key is what guards it)."""
    timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.request(method, url, json=body, headers=headers) as response:
            text = await response.text()
            try:
                return response.status, await response.json(content_type=None)
            except ValueError:
                return response.status, text
