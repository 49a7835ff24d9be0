"""The e2e suite's own helpers (e2e/checks.py), on CPU: they decide what a cluster run reports."""

from __future__ import annotations

from typing import Any

import pytest

from e2e.checks import KubectlError, free_gpus, pod_gpu_request, wait_until


class FakeClock:
    """Time that moves only when the waiter sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps = 0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds


def wait(probe: Any, clock: FakeClock, timeout: float = 900) -> Any:
    return wait_until(probe, timeout, "the thing", interval=3, clock=clock, sleep=clock.sleep)


def test_a_failed_assertion_in_the_probe_surfaces_at_once_with_its_message() -> None:
    """A failed Job is final: it must read as the Job's failure, not a 15-minute timeout."""
    clock = FakeClock()

    def job_failed() -> None:
        raise AssertionError("job loader failed:\nOSError: no space left on device")

    with pytest.raises(AssertionError, match="no space left on device"):
        wait(job_failed, clock)
    assert clock.sleeps == 0


def test_kubectl_errors_are_retried_until_the_probe_answers() -> None:
    clock = FakeClock()
    answers = iter([KubectlError("NotFound"), KubectlError("NotFound"), None, {"phase": "Ok"}])

    def probe() -> Any:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert wait(probe, clock) == {"phase": "Ok"}
    assert clock.sleeps == 3


def test_a_timeout_names_what_was_awaited_and_the_last_answer() -> None:
    clock = FakeClock()

    def never() -> None:
        raise KubectlError('deployments.apps "x" not found')

    with pytest.raises(
        AssertionError, match=r"timed out after 30s waiting for the thing.*not found"
    ):
        wait(never, clock, timeout=30)
    assert clock.now >= 30


def node(name: str, gpus: int, *, cordoned: bool = False) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {"unschedulable": True} if cordoned else {},
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "8"}},
    }


def pod(node_name: str | None, *gpus: int, phase: str = "Running", **spec: Any) -> dict[str, Any]:
    containers = [
        {
            "name": f"c{i}",
            "resources": {"limits": {"nvidia.com/gpu": n}, "requests": {"nvidia.com/gpu": n}},
        }
        for i, n in enumerate(gpus)
    ]
    body: dict[str, Any] = {"containers": containers, **spec}
    if node_name:
        body["nodeName"] = node_name
    return {"spec": body, "status": {"phase": phase}}


def test_free_gpus_subtracts_what_running_pods_request() -> None:
    nodes = [node("a", 4), node("b", 2)]
    pods = [pod("a", 1, 1), pod("b", 2), pod("a", 0)]
    # The old helper summed allocatable alone and answered 6 here.
    assert free_gpus(nodes, pods) == 2


def test_finished_unbound_and_cpu_pods_hold_no_gpu() -> None:
    nodes = [node("a", 4)]
    pods = [
        pod("a", 2, phase="Succeeded"),
        pod("a", 1, phase="Failed"),
        pod(None, 4, phase="Pending"),  # not scheduled yet: takes nothing on a node
        {
            "spec": {"nodeName": "a", "containers": [{"name": "cpu"}]},
            "status": {"phase": "Running"},
        },
    ]
    assert free_gpus(nodes, pods) == 4


def test_cordoned_nodes_and_overcommitted_nodes_offer_nothing() -> None:
    nodes = [node("a", 4, cordoned=True), node("b", 1), node("c", 0)]
    pods = [pod("b", 1), pod("b", 1)]  # more than allocatable (a device plugin restart)
    assert free_gpus(nodes, pods) == 0


def test_init_containers_count_as_the_scheduler_counts_them() -> None:
    plain_init = {"name": "init", "resources": {"requests": {"nvidia.com/gpu": "3"}}}
    sidecar = {
        "name": "side",
        "restartPolicy": "Always",
        "resources": {"limits": {"nvidia.com/gpu": 1}},
    }
    assert pod_gpu_request(pod("a", 1, initContainers=[plain_init])) == 3
    assert pod_gpu_request(pod("a", 1, initContainers=[sidecar])) == 2
