"""Pure helpers of the e2e suite: waiting on a condition and counting free GPUs.

They take plain callables and dicts (no cluster), so tests/k8s/test_e2e_helpers.py checks
them on CPU; the cluster tests call them with what kubectl returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"


class KubectlError(Exception):
    """kubectl exited non-zero. Inside `wait_until` this is a passing state (the object is
    not created yet, the API server is busy) and is retried, unlike a failed assertion."""


def wait_until(
    probe: Callable[[], Any],
    timeout: float,
    what: str,
    interval: float = 3,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Any:
    """The probe's first truthy value. A probe that raises AssertionError has seen an
    outcome that will not change (a failed Job, an error condition): that propagates at
    once with its own message, instead of becoming a timeout many minutes later. A
    KubectlError is retried until the deadline and is named in the timeout's message."""
    deadline = clock() + timeout
    last: Any = None
    while True:
        try:
            last = probe()
        except KubectlError as error:
            last = error
        else:
            if last:
                return last
        if clock() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last={last!r}")
        sleep(interval)


def _gpus(container: dict[str, Any]) -> int:
    # Extended resources take whole numbers only, and the API server defaults a missing
    # request to the limit, so a running pod's requests name what the scheduler counted.
    resources = container.get("resources") or {}
    amount = (resources.get("requests") or {}).get(GPU_RESOURCE)
    if amount is None:
        amount = (resources.get("limits") or {}).get(GPU_RESOURCE, 0)
    return int(amount)


def pod_gpu_request(pod: dict[str, Any]) -> int:
    """GPUs the scheduler reserves for a pod: the sum over its containers and restartable
    (sidecar) init containers, or the largest plain init container when that is more
    (the rule of the scheduler's resource fit; Kubernetes docs, "Resource sharing within
    containers" and "Sidecar containers")."""
    spec = pod.get("spec") or {}
    inits = spec.get("initContainers") or []
    sidecars = [c for c in inits if c.get("restartPolicy") == "Always"]
    running = sum(_gpus(c) for c in [*(spec.get("containers") or []), *sidecars])
    plain_inits = [_gpus(c) for c in inits if c.get("restartPolicy") != "Always"]
    return max([running, *plain_inits])


def free_gpus(nodes: Iterable[dict[str, Any]], pods: Iterable[dict[str, Any]]) -> int:
    """GPUs left for new pods: each schedulable node's allocatable GPUs minus what the pods
    bound to it request. Finished pods (Succeeded, Failed) hold nothing."""
    taken: dict[str, int] = {}
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        phase = (pod.get("status") or {}).get("phase")
        if node and phase not in ("Succeeded", "Failed"):
            taken[node] = taken.get(node, 0) + pod_gpu_request(pod)
    free = 0
    for node in nodes:
        if (node.get("spec") or {}).get("unschedulable"):
            continue  # cordoned: nothing new lands there
        allocatable = int(
            ((node.get("status") or {}).get("allocatable") or {}).get(GPU_RESOURCE, 0)
        )
        free += max(0, allocatable - taken.get(node["metadata"]["name"], 0))
    return free
