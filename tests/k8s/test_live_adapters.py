"""Adapters served live (``live_adapters``, ``adapter_sync``): each Ready engine's plan, its
answers as status entries, the AdaptersReady condition and the Events, against engines
played by a fake admin API (the real one: tests/server/test_lora_server.py; both together
through a real operator: test_adapters_kmock.py)."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from pagoda_operator import constants as c
from pagoda_operator.adapter_sync import LIST_PATH, LOAD_PATH, UNLOAD_PATH, admin_url, sync_adapters
from pagoda_operator.live_adapters import pod_plan
from pagoda_operator.live_settings import ADMIN_SECRET_KEY
from pagoda_operator.spec import with_defaults

SQL = {"name": "sql", "uri": "/opt/adapters/sql"}
CHAT = {"name": "chat", "uri": "/opt/adapters/chat"}
BIG = {"name": "big", "uri": "/opt/adapters/rank-64"}
KEY = "the-admin-key"


def llmd(adapters: list[dict[str, Any]], status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": c.API_VERSION, "kind": c.KIND,
        "metadata": {"name": "qwen", "namespace": "ml", "uid": "uid-1", "generation": 2},
        "spec": {"model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, "adapters": adapters},
        "status": status or {},
    }  # fmt: skip


def pod(name: str, address: str, *, ready: bool = True, admin_port: int = 8001) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ml"},
        "spec": {"containers": [{"name": "engine", "ports": [
            {"name": "http", "containerPort": 8000}, {"name": "admin", "containerPort": admin_port}]}]},
        "status": {"podIP": address,
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }  # fmt: skip


class Cluster:
    """What sync_adapters reads of the API: the admin Secret and the engine pods."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = pods

    async def get(self, path: str) -> dict[str, Any] | None:
        assert path.endswith("/secrets/qwen-engine-admin"), path
        return {"data": {ADMIN_SECRET_KEY: base64.b64encode(KEY.encode()).decode()}}

    async def list(self, path: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        assert path.endswith("/namespaces/ml/pods") and labels[c.LABEL_OWNER] == "qwen"
        return self.pods


class Engines:
    """The engines' admin API, one adapter table per address; a rank-64 folder is refused
    as the engine refuses it, and an address in ``down`` does not answer."""

    def __init__(self, served: dict[str, dict[str, str]]) -> None:
        self.served = served
        self.down: set[str] = set()
        self.calls: list[tuple[str, str, str]] = []

    async def __call__(self, method: str, url: str, key: str, body: dict[str, Any] | None):
        address, path = url.removeprefix("http://").split(":", 1)[0], "/" + url.split("/", 3)[3]
        assert key == KEY
        if address in self.down:
            raise ConnectionRefusedError(111, "Connection refused")
        table = self.served[address]
        self.calls.append((address, method, path))
        if path == LIST_PATH:
            adapters = [{"name": n, "path": p, "base_model_name": "q"} for n, p in table.items()]
            return 200, {"enabled": True, "adapters": adapters}
        name = (body or {})["lora_name"]
        if path == UNLOAD_PATH:
            if table.pop(name, None) is None:
                return 404, {"error": {"message": f"The LoRA adapter '{name}' cannot be found."}}
            return 200, f"Success: LoRA adapter '{name}' removed successfully."
        assert path == LOAD_PATH
        if "rank-64" in body["lora_path"]:
            return 400, {"error": {"message": f"{body['lora_path']}: rank 64 exceeds "
                                              "--max-lora-rank 16"}}  # fmt: skip
        table[name] = body["lora_path"]
        return 200, f"Success: LoRA adapter '{name}' added successfully."


def run(obj: dict[str, Any], pods: list[dict[str, Any]], engines: Engines, delivered=True):
    spec = with_defaults(obj["spec"])
    return asyncio.run(sync_adapters(Cluster(pods), obj, spec, delivered=delivered, call=engines))  # type: ignore[arg-type]


def test_a_pod_unloads_what_was_removed_or_moved_then_loads_what_it_lacks() -> None:
    plan = pod_plan({"sql": "/a/sql-2", "chat": "/a/chat"}, {"sql": "/a/sql-1", "old": "/a/old"})
    assert plan.unload == ["sql", "old"]
    assert plan.load == [("sql", "/a/sql-2"), ("chat", "/a/chat")]
    assert pod_plan({"chat": "/a/chat"}, {"chat": "/a/chat"}) == pod_plan({}, {})


def test_an_added_adapter_is_loaded_into_every_ready_engine() -> None:
    engines = Engines({"10.0.0.1": {"sql": "/opt/adapters/sql"}, "10.0.0.2": {}})
    pods = [pod("qwen-b", "10.0.0.2"), pod("qwen-a", "10.0.0.1"),
            pod("qwen-c", "10.0.0.3", ready=False)]  # fmt: skip
    report = run(llmd([SQL, CHAT]), pods, engines)
    assert engines.served["10.0.0.1"] == engines.served["10.0.0.2"] == {
        "sql": "/opt/adapters/sql", "chat": "/opt/adapters/chat"}  # fmt: skip
    assert [(e["name"], e["state"]) for e in report.entries] == [("sql", "Loaded"),
                                                                  ("chat", "Loaded")]  # fmt: skip
    assert report.entries[1]["pods"] == [{"name": "qwen-a", "state": "Loaded"},
                                         {"name": "qwen-b", "state": "Loaded"}]  # fmt: skip
    assert report.condition["status"] == "True"
    assert ("Normal", "AdapterLoaded", "adapter chat loaded live into qwen-a, qwen-b") in (
        report.events
    )
    # The next round finds nothing to do, and says nothing new.
    again = run(llmd([SQL, CHAT], {"adapters": report.entries}), pods, engines)
    assert [call[1] for call in engines.calls[-2:]] == ["GET", "GET"] and again.events == []


def test_a_removed_adapter_is_unloaded_and_a_moved_one_reloaded() -> None:
    engines = Engines({"10.0.0.1": {"sql": "/opt/adapters/sql", "chat": "/opt/adapters/chat"}})
    moved = {**SQL, "uri": "/opt/adapters/sql-v2"}
    report = run(llmd([moved]), [pod("qwen-a", "10.0.0.1")], engines)
    assert engines.served["10.0.0.1"] == {"sql": "/opt/adapters/sql-v2"}
    assert [e["name"] for e in report.entries] == ["sql"]
    assert report.entries[0]["path"] == "/opt/adapters/sql-v2"
    events = {event[1]: event[2] for event in report.events}
    assert events["AdapterUnloaded"] == "adapter chat unloaded from qwen-a"  # not sql: moved
    assert "AdapterLoaded" in events


def test_a_refused_adapter_fails_naming_the_pod_and_the_others_keep_serving() -> None:
    engines = Engines({"10.0.0.1": {"sql": "/opt/adapters/sql"}, "10.0.0.2": {}})
    pods = [pod("qwen-a", "10.0.0.1"), pod("qwen-b", "10.0.0.2")]
    engines.down.add("10.0.0.2")
    report = run(llmd([SQL, BIG]), pods, engines)
    by_name = {entry["name"]: entry for entry in report.entries}
    assert engines.served["10.0.0.1"] == {"sql": "/opt/adapters/sql"}
    assert by_name["big"]["state"] == "Failed"
    assert by_name["big"]["message"].startswith("pod qwen-a refused it: HTTP 400: ")
    assert "rank 64 exceeds --max-lora-rank 16" in by_name["big"]["message"]
    # The pod that did not answer is left for the next round, not failed.
    assert (
        by_name["sql"]["state"] == "Loading" and "qwen-b: unreachable" in by_name["sql"]["message"]
    )
    assert report.condition["status"] == "False" and report.condition["reason"] == "AdapterFailed"
    assert "adapter big: pod qwen-a refused it" in report.condition["message"]
    (failed,) = [e for e in report.events if e[1] == "AdapterFailed"]
    assert failed[0] == "Warning" and "qwen-a" in failed[2] and "big" in failed[2]
    # Tried again next round, but reported once (no Event on every reconcile).
    again = run(llmd([SQL, BIG], {"adapters": report.entries}), pods, engines)
    assert not [e for e in again.events if e[1] == "AdapterFailed"]


def test_nothing_is_asked_until_the_loader_delivered_the_adapters() -> None:
    engines = Engines({"10.0.0.1": {}})
    loaded = {"name": "sql", "path": "/opt/adapters/sql", "state": "Loaded", "message": "",
              "pods": []}  # fmt: skip
    report = run(llmd([SQL, CHAT], {"adapters": [loaded]}), [pod("qwen-a", "10.0.0.1")],
                 engines, delivered=False)  # fmt: skip
    assert engines.calls == []
    assert report.entries[0] == loaded  # served meanwhile, as recorded
    assert report.entries[1]["state"] == "Pending" and "loader Job" in report.entries[1]["message"]
    assert report.condition["reason"] == "AdaptersLoading"


def test_the_admin_url_is_the_port_the_pod_declares() -> None:
    assert admin_url(pod("a", "10.0.0.9", admin_port=9101)) == "http://10.0.0.9:9101"
    assert admin_url(pod("a", "10.0.0.9", ready=False)) is None
    going = pod("a", "10.0.0.9")
    going["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    assert admin_url(going) is None


def test_the_report_reaches_the_status_and_a_failure_is_rechecked() -> None:
    from pagoda_operator.status import needs_recheck, workload_status

    engines = Engines({"10.0.0.1": {}})
    obj = llmd([SQL, BIG])
    report = run(obj, [pod("qwen-a", "10.0.0.1")], engines)
    deployment = {"spec": {"replicas": 1}, "status": {"replicas": 1, "readyReplicas": 1,
                                                      "updatedReplicas": 1, "observedGeneration": 1},
                  "metadata": {"generation": 1}}  # fmt: skip
    status = workload_status(obj, deployment, "2025-01-01T00:00:00Z", adapters=report)
    assert [entry["state"] for entry in status["adapters"]] == ["Loaded", "Failed"]
    ready = next(cond for cond in status["conditions"] if cond["type"] == "AdaptersReady")
    assert ready["status"] == "False" and ready["observedGeneration"] == 2
    assert status["phase"] == "Available"
    assert needs_recheck({**obj, "status": status})  # tried again, and left out of start-ups
    # LoRA off: no record left behind (a merge patch of None removes it).
    assert workload_status(obj, deployment, "2025-01-01T00:00:00Z")["adapters"] is None
