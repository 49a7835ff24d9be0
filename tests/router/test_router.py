"""`pagoda router` against fake engines on localhost: prefix affinity, bounded load,
retries of requests that never started, streams passed through as they come, and the
engine server's error shapes."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from inference.router.backends import BackendPool, parse_backend, parse_metrics
from inference.router.picking import Ring, affinity_order, bounded_capacity, prefix_key
from inference.router.proxy import RouterSettings, build_router_app

from .fake_engines import MODEL, FakeEngine, Served, chat, free_port, serve_engine, wait_until


@contextlib.contextmanager
def router_over(urls: list[str], **settings: Any) -> Iterator[httpx.Client]:
    settings.setdefault("scrape_interval_s", 0.2)
    app = build_router_app(BackendPool([f"{MODEL}={u}" for u in urls]), RouterSettings(**settings))
    with Served(app) as router, httpx.Client(base_url=router.url, timeout=30) as client:
        yield client


@contextlib.contextmanager
def engines(count: int) -> Iterator[list[tuple[FakeEngine, Served]]]:
    with contextlib.ExitStack() as stack:
        fakes = [FakeEngine(f"e{i}") for i in range(count)]
        yield [(fake, stack.enter_context(serve_engine(fake))) for fake in fakes]


def test_a_conversation_stays_on_one_engine_and_conversations_spread() -> None:
    with engines(3) as running, router_over([s.url for _, s in running]) as client:
        homes: dict[int, set[str]] = {}
        for conversation in range(12):
            for turn in range(4):
                response = chat(client, conversation, turn)
                assert response.status_code == 200, response.text
                homes.setdefault(conversation, set()).add(response.json()["engine"])
        assert all(len(home) == 1 for home in homes.values()), homes
        assert len(set.union(*homes.values())) >= 2  # 12 conversations do not share one


def test_a_hot_conversation_overflows_to_another_engine_within_the_bound() -> None:
    """Turns of one conversation held open at once: its engine takes them while it carries
    at most ceil(1.25 * (in flight + 1) / 2); the others go to the next engine."""
    with engines(2) as running, router_over([s.url for _, s in running]) as client:
        for fake, _ in running:
            fake.hold = True
        with httpx.Client(base_url=str(client.base_url), timeout=60) as streams:
            opened = []
            for index in range(6):
                request = streams.build_request(
                    "POST", "/v1/chat/completions",
                    json={"model": MODEL, "stream": True,
                          "messages": [{"role": "user", "content": "the same opening"}]},
                )  # fmt: skip
                opened.append(streams.send(request, stream=True))
                wait_until(lambda n=index + 1: sum(f.open_streams for f, _ in running) == n,
                           what=f"{index + 1} streams open")  # fmt: skip
            counts = sorted(fake.open_streams for fake, _ in running)
            assert counts == [2, 4], counts  # 1.25x bound with 2 engines: see the docstring
            for fake, _ in running:
                fake.release()
            for response in opened:
                assert b"[DONE]" in response.read()
                response.close()


def test_requests_that_never_started_go_to_another_engine() -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with engines(2) as running:
        refusing, _ = running[0]
        refusing.refuse = True
        urls = [dead] + [s.url for _, s in running]
        with router_over(urls, scrape_interval_s=30.0) as client:
            for conversation in range(8):
                response = chat(client, conversation, 0)
                assert response.status_code == 200, response.text
                assert response.json()["engine"] == running[1][0].name
            metrics = client.get("/metrics").text
            assert "pagoda_router_retries_total" in metrics
            retried = sum(
                float(line.rsplit(" ", 1)[1])
                for line in metrics.splitlines()
                if line.startswith("pagoda_router_retries_total")
            )
            assert retried >= 1


def test_every_engine_refusing_passes_on_the_engines_answer() -> None:
    with engines(2) as running:
        for fake, _ in running:
            fake.refuse = True
        with router_over([s.url for _, s in running]) as client:
            response = chat(client, 0, 0)
            assert response.status_code == 503
            assert response.json()["error"]["type"] == "service_unavailable_error"


def test_a_stream_reaches_the_client_before_the_engine_finishes_it() -> None:
    with engines(1) as running, router_over([running[0][1].url]) as client:
        fake, _ = running[0]
        fake.hold = True
        messages = [{"role": "user", "content": "stream please"}]
        body = {"model": MODEL, "stream": True, "messages": messages}
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = response.iter_lines()
            first = next(line for line in lines if line)
            assert json.loads(first.removeprefix("data: ")) == {"engine": "e0", "part": 1}
            assert fake.open_streams == 1  # the engine still holds the rest
            fake.release()
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"


def test_errors_have_the_engine_servers_shape() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with router_over([dead]) as client:
        unknown = client.post("/v1/chat/completions", json={"model": "other", "messages": []})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found"
        down = chat(client, 0, 0)
        assert down.status_code == 503
        assert set(down.json()["error"]) == {"message", "type", "param", "code"}
        bad = client.post("/v1/chat/completions", content=b"{not json")
        assert bad.status_code == 400
        assert client.get("/ready").status_code == 503


def test_the_api_key_is_checked_and_passed_on() -> None:
    with engines(1) as running, router_over([running[0][1].url], api_key="k") as client:
        assert chat(client, 0, 0).status_code == 401
        client.headers["Authorization"] = "Bearer k"
        assert chat(client, 0, 0).status_code == 200


# --- the pure parts ------------------------------------------------------------------------


def test_turns_of_a_conversation_share_a_key_and_conversations_do_not() -> None:
    def body(conversation: int, turns: int) -> dict[str, Any]:
        messages = [{"role": "system", "content": "s"},
                    {"role": "user", "content": f"c{conversation}"}]  # fmt: skip
        turn = [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]
        messages += turn * turns
        return {"messages": messages}

    assert prefix_key(body(1, 0), 2048) == prefix_key(body(1, 3), 2048)
    assert prefix_key(body(1, 0), 2048) != prefix_key(body(2, 0), 2048)
    assert prefix_key({"prompt": "abcdef"}, 3) == "abc"
    assert prefix_key({}, 10) is None


def test_removing_an_engine_moves_only_its_keys() -> None:
    urls = [f"http://e{i}" for i in range(4)]
    full, without = Ring.of(urls), Ring.of(urls[:3])
    keys = [f"conversation {i}" for i in range(400)]
    moved = [k for k in keys if full.walk(k)[0] != without.walk(k)[0]]
    assert all(full.walk(k)[0] == urls[3] for k in moved)
    assert 40 < len(moved) < 160  # about a quarter


def test_bounded_load_never_lets_one_engine_exceed_its_share() -> None:
    ring = Ring.of(["a", "b", "c"])
    in_flight = {"a": 0, "b": 0, "c": 0}
    for _ in range(60):
        total = sum(in_flight.values())
        chosen = affinity_order("one hot key", ring, in_flight, 1.25)[0]
        assert in_flight[chosen] < bounded_capacity(total, 3, 1.25)
        in_flight[chosen] += 1
    assert max(in_flight.values()) <= bounded_capacity(59, 3, 1.25)


def test_backend_flags_and_metrics_parse() -> None:
    assert parse_backend("m=http://h:8000/") == ("m", "http://h:8000")
    assert parse_backend("http://h:8000") == (None, "http://h:8000")
    with pytest.raises(ValueError, match="http"):
        parse_backend("m=h:8000")
    text = 'vllm:num_requests_waiting{a="1"} 2\nvllm:num_requests_waiting{a="2"} 3\n# x\n'
    assert parse_metrics(text + "vllm:kv_cache_usage_perc 0.5\n") == {
        "waiting": 5.0, "kv_cache_usage": 0.5,
    }  # fmt: skip


def test_without_a_prefix_the_least_loaded_engine_by_its_metrics_gets_the_request() -> None:
    with engines(2) as running:
        busy, idle = running[0][0], running[1][0]
        busy.waiting_gauge = 7.0  # its own queue, as its /metrics reports it
        with router_over([s.url for _, s in running], policy="least-load") as client:
            wait_until(
                lambda: any(b["waiting"] == 7.0 for b in client.get("/router/backends").json()
                            ["backends"]),
                what="the busy engine's gauge scraped",
            )  # fmt: skip
            for conversation in range(5):
                assert chat(client, conversation, 0).json()["engine"] == idle.name


def test_a_bare_backend_url_says_what_it_serves() -> None:
    fake = FakeEngine("e0", models=(MODEL, "tiny-lora"))
    with serve_engine(fake) as engine:
        app = build_router_app(BackendPool([engine.url]), RouterSettings())
        with Served(app) as router, httpx.Client(base_url=router.url) as client:
            served = {card["id"] for card in client.get("/v1/models").json()["data"]}
            assert served == {MODEL, "tiny-lora"}
            body = {"model": "tiny-lora", "messages": [{"role": "user", "content": "x"}]}
            assert client.post("/v1/chat/completions", json=body).json()["engine"] == "e0"


def endpoint_slice(url: str, ready: bool) -> dict[str, Any]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return {
        "metadata": {"labels": {"app.kubernetes.io/name": "pagoda-engine"}},
        "ports": [{"name": "http", "port": int(port), "protocol": "TCP"}],
        "endpoints": [{"addresses": [host], "conditions": {"ready": ready}}],
    }


def test_engines_are_found_in_the_namespaces_endpoint_slices() -> None:
    """The router follows the LLMDeployments' EndpointSlices: a ready engine is routed to,
    one that stops being ready is dropped."""
    from fastapi import FastAPI

    from inference.router.kubernetes import KubeSource

    fake = FakeEngine("e0")
    slices: dict[str, Any] = {"ready": True}
    asked: list[str] = []
    api = FastAPI()

    with serve_engine(fake) as engine:

        @api.get("/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices")
        async def list_slices(
            namespace: str, labelSelector: str = ""  # noqa: N803 (the API's parameter)
        ) -> dict[str, Any]:
            asked.append(f"{namespace}?{labelSelector}")
            return {"items": [endpoint_slice(engine.url, slices["ready"])]}

        @api.get("/apis/pagoda.dev/v1alpha1/namespaces/{namespace}/llmdeployments")
        async def list_llmds(namespace: str) -> dict[str, Any]:
            return {"items": [{"status": {"modelName": "at-zero"}}]}

        with Served(api) as kube:
            source = KubeSource("llm", api_url=kube.url)
            app = build_router_app(BackendPool([], source), RouterSettings(scrape_interval_s=0.2))
            with Served(app) as router, httpx.Client(base_url=router.url) as client:
                assert asked[0] == "llm?app.kubernetes.io/name=pagoda-engine"
                assert chat(client, 0, 0).json()["engine"] == "e0"
                slices["ready"] = False
                wait_until(lambda: client.get("/v1/models").json()["data"] == [],
                           what="the engine dropped")  # fmt: skip
                # A model seen before is not unknown: no engine serves it right now.
                gone = chat(client, 0, 0)
                assert gone.status_code == 503, gone.text
                assert "right now" in gone.json()["error"]["message"]
                # An LLMDeployment without engines (at zero replicas) is known too.
                body = {"model": "at-zero", "messages": [{"role": "user", "content": "x"}]}
                assert client.post("/v1/chat/completions", json=body).status_code == 503


def test_the_router_manifest_runs_what_the_cli_accepts() -> None:
    """manifests/router/router.yaml's arguments parse, and its Role grants what
    --discover-namespace reads (the manifest's Kubernetes schema: tests/k8s/test_manifests.py)."""
    import argparse
    from pathlib import Path

    import yaml

    from inference.router.cli import add_router_args

    path = Path(__file__).resolve().parents[2] / "manifests" / "router" / "router.yaml"
    documents = {d["kind"]: d for d in yaml.safe_load_all(path.read_text())}
    (container,) = documents["Deployment"]["spec"]["template"]["spec"]["containers"]
    args = [a.replace("$(POD_NAMESPACE)", "llm") for a in container["args"]]
    assert args[0] == "router"
    parsed = add_router_args(argparse.ArgumentParser()).parse_args(args[1:])
    assert parsed.discover_namespace == "llm"
    assert str(parsed.port) == str(container["ports"][0]["containerPort"])
    granted = {(r["apiGroups"][0], r["resources"][0], tuple(r["verbs"]))
               for r in documents["Role"]["rules"]}  # fmt: skip
    assert granted == {
        ("discovery.k8s.io", "endpointslices", ("list",)),
        ("pagoda.dev", "llmdeployments", ("list",)),
    }


def held_requests(client: httpx.Client) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in client.get("/metrics").text.splitlines()
        if line.startswith("pagoda_router_held_requests{")
    )


def test_a_request_is_held_until_an_engine_comes_up_from_zero() -> None:
    """No engine listens yet (a model at zero replicas): the request waits, counted as
    demand, and is answered once an engine starts on the backend's address."""
    import threading

    fake = FakeEngine("cold")
    later = serve_engine(fake)  # its port is chosen; nothing listens on it yet
    with router_over([later.url], cold_start_timeout_s=60.0) as client:
        answers: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: answers.append(chat(client, 0, 0)))
        waiter.start()
        wait_until(lambda: held_requests(client) == 1, what="the request held as demand")
        with later:
            waiter.join(timeout=60)
            assert answers and answers[0].status_code == 200, answers
            assert answers[0].json()["engine"] == "cold"
        assert held_requests(client) == 0


def test_a_held_request_gets_a_clear_503_at_its_deadline() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with router_over([dead], cold_start_timeout_s=1.0) as client:
        response = chat(client, 0, 0)
        assert response.status_code == 503
        assert "zero replicas" in response.json()["error"]["message"]
        assert response.headers["retry-after"] == "10"


def test_a_client_that_goes_away_closes_the_engines_stream() -> None:
    """The engine's request is aborted (its stream closed) and the router's in-flight
    count, which the bounded load reads, comes back to 0."""
    with engines(1) as running, router_over([running[0][1].url]) as client:
        fake, _ = running[0]
        fake.hold = True
        body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}]}
        with httpx.Client(base_url=str(client.base_url), timeout=30) as gone:
            with gone.stream("POST", "/v1/chat/completions", json=body) as response:
                next(response.iter_lines())
                assert fake.open_streams == 1
        wait_until(lambda: fake.open_streams == 0, what="the engine's stream closed")

        def in_flight() -> int:
            return client.get("/router/backends").json()["backends"][0]["in_flight"]

        wait_until(lambda: in_flight() == 0, what="the router's count back to 0")


def test_a_held_request_waits_through_an_engine_that_is_still_loading() -> None:
    """An engine that listens but answers 503 (its model still loading) is not up yet: the
    request stays held and is answered once the engine is ready."""
    with engines(1) as running:
        fake, _ = running[0]
        fake.refuse = True
        with router_over([running[0][1].url], cold_start_timeout_s=60.0) as client:
            import threading

            answers: list[httpx.Response] = []
            waiter = threading.Thread(target=lambda: answers.append(chat(client, 0, 0)))
            waiter.start()
            wait_until(lambda: held_requests(client) == 1, what="held while loading")
            fake.refuse = False
            waiter.join(timeout=60)
            assert answers and answers[0].status_code == 200, answers


def test_an_engine_busy_with_other_clients_counts_as_loaded() -> None:
    """Bounded load counts what an engine reports running and waiting when that is more
    than the router's own requests to it (other routers, other clients)."""
    from inference.router.backends import Backend

    assert Backend("u", in_flight=2, running=1.0, waiting=0.0).requests() == 2
    assert Backend("u", in_flight=1, running=5.0, waiting=3.0).requests() == 8
