"""The operator's tuner loop (in place of a kopf timer, which would put a finalizer on every
tuned object): one window per tuned LLMDeployment per interval, never two at once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from pagoda_operator import handlers
from pagoda_operator.desired import MonitorSettings
from pagoda_operator.tuning import runner


def llmd(name: str, mode: str, **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}", **meta},
        "spec": {"model": {"name": "m"}, "tuning": {"mode": mode}},
    }


class FakeClient:
    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items
        self.events: list[tuple[str, str, str]] = []

    async def post_event(
        self, obj: dict[str, Any], event_type: str, reason: str, message: str
    ) -> None:
        self.events.append((obj["metadata"]["name"], event_type, reason))

    async def get(self, path: str) -> dict[str, Any]:
        assert path == "/apis/pagoda.dev/v1alpha1/llmdeployments"
        return {"items": self.items}


def test_tuner_loop_runs_each_tuned_object_one_window_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    slow_release = asyncio.Event()

    async def fake_tune(client: Any, obj: dict[str, Any], *, emit: Any, **_: Any) -> None:
        calls.append(obj["metadata"]["name"])
        # Outside kopf's handlers: the Event must still be posted (kopf.event cannot).
        emit("Normal", "TuningRecommendation", "raise maxNumSeqs")
        assert obj["kind"] == "LLMDeployment"
        if obj["metadata"]["name"] == "slow":
            await slow_release.wait()
        if obj["metadata"]["name"] == "broken":
            raise RuntimeError("prometheus exploded")

    monkeypatch.setattr(runner, "interval_seconds", lambda: 0.01)
    monkeypatch.setattr(runner, "tune", fake_tune)
    items = [
        llmd("tuned", "Auto"),
        llmd("slow", "Recommend"),
        llmd("broken", "Auto"),
        llmd("off", "Off"),
        llmd("going", "Auto", deletionTimestamp="2025-01-01T00:00:00Z"),
    ]
    client = FakeClient(items)
    memo = SimpleNamespace(client=client, tuner_running={}, tuner_events=set())

    async def run() -> None:
        task = asyncio.create_task(handlers.tuner_loop(memo))
        await asyncio.sleep(0.3)
        slow_release.set()
        task.cancel()
        await asyncio.gather(task, *memo.tuner_running.values(), return_exceptions=True)
        await asyncio.gather(*memo.tuner_events, return_exceptions=True)

    asyncio.run(run())
    assert calls.count("tuned") >= 3  # every round
    assert calls.count("broken") >= 3  # a failed window does not stop the next ones
    assert calls.count("slow") == 1  # still running: not started again
    assert "off" not in calls and "going" not in calls
    assert ("tuned", "Normal", "TuningRecommendation") in client.events


def test_tuner_window_applies_through_reconcile_with_the_operators_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The tuner renders the Deployment from spec + overrides through ``apply_owned``: a
    # reconcile with the operator's image, ServiceMonitor switch and monitor settings, whose
    # Events go through the operator's own client as the tuner's do.
    reconciled: list[tuple[str, dict[str, Any]]] = []

    async def fake_reconcile(client: Any, obj: dict[str, Any], *, emit: Any, **kwargs: Any) -> None:
        reconciled.append((obj["metadata"]["name"], kwargs))
        emit("Normal", "Updated", "Updated Deployment tuned")

    async def fake_tune(client: Any, obj: dict[str, Any], *, apply_owned: Any, **_: Any) -> None:
        await apply_owned(obj)

    monkeypatch.setattr(handlers, "reconcile", fake_reconcile)
    monkeypatch.setattr(runner, "tune", fake_tune)
    client = FakeClient([])
    monitor = MonitorSettings(labels={"release": "prom"}, interval="30s")
    memo = SimpleNamespace(
        client=client,
        tuner_events=set(),
        default_image="engine:1",
        picker_image="epp:1",
        service_monitors=False,
        monitor=monitor,
    )

    async def run() -> None:
        await handlers.tune_llmdeployment(llmd("tuned", "Auto"), memo)
        await asyncio.gather(*memo.tuner_events, return_exceptions=True)

    asyncio.run(run())
    assert len(reconciled) == 1
    name, kwargs = reconciled[0]
    assert name == "tuned"
    assert kwargs["monitor"] is monitor
    assert kwargs["default_image"] == "engine:1"
    assert kwargs["service_monitors"] is False
    assert ("tuned", "Normal", "Updated") in client.events
