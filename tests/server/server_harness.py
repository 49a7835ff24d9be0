"""Real uvicorn servers for the server tests: in a thread of the test process (so tests can
look at the engine's KV blocks, which the engine process reports) or as a `pagoda serve`
subprocess (for signals). Either way the engine itself runs in a child process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from inference.async_engine import AsyncLLMEngine
from inference.config import EngineConfig
from inference.server.app import build_app
from inference.server.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 180.0
# The shared tiny-model server: small enough that every request finishes fast on two CPU
# cores, big enough for the limit tests (prompt + max_tokens > max_model_len) to mean something.
TINY_MAX_MODEL_LEN = 256
TINY_NUM_KV_BLOCKS = 64


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(base_url: str, timeout: float = READY_TIMEOUT_S, proc=None, engine=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        if engine is not None and engine.failure is not None:
            raise RuntimeError(f"engine failed to start: {engine.failure!r}")
        try:
            if httpx.get(f"{base_url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{base_url} not ready after {timeout:.0f}s")


class ServerThread:
    """The app under a real uvicorn server on a loopback socket, in a background thread."""

    def __init__(
        self,
        model: str,
        *,
        served_model_names: list[str] | None = None,
        api_key: str | None = None,
        max_queue_len: int | None = None,
        shutdown_grace_s: float = 5.0,
        engine_factory=None,
        engine_step_timeout_s: float | None = None,
        app_kwargs: dict | None = None,
        admin_api_key: str | None = None,
        **engine_kwargs,
    ) -> None:
        """``admin_api_key``: also serve the admin API (``inference.server.admin``) on a
        port of its own, ``admin_url``, in the same event loop (as ``pagoda serve
        --admin-port`` does)."""
        import uvicorn

        engine_kwargs.setdefault("device", "cpu")
        names = served_model_names or [Path(model).name]
        config = EngineConfig.from_kwargs(model, served_model_name=names[0], **engine_kwargs)
        self.metrics = ServerMetrics(names[0])
        extra = {"engine_factory": engine_factory} if engine_factory is not None else {}
        if engine_step_timeout_s is not None:
            extra["engine_step_timeout_s"] = engine_step_timeout_s
        self.engine = AsyncLLMEngine(
            config, max_queue_len=max_queue_len, observer=self.metrics, **extra
        )
        self.app = build_app(
            self.engine,
            self.metrics,
            names,
            api_key=api_key,
            shutdown_grace_s=shutdown_grace_s,
            **(app_kwargs or {}),
        )
        self.model_name = names[0]
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        uv_config = uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(uv_config)
        self.admin_server = self.admin_url = None
        serving = [(self.server, self._sock)]
        if admin_api_key is not None:
            from inference.server.admin import build_admin_app

            admin_sock = socket.socket()
            admin_sock.bind(("127.0.0.1", 0))
            self.admin_url = f"http://127.0.0.1:{admin_sock.getsockname()[1]}"
            self.admin_server = uvicorn.Server(uvicorn.Config(
                build_admin_app(self.engine, admin_api_key, self.app.state.adapters),
                log_level="warning",
                lifespan="off"))  # fmt: skip
            serving.append((self.admin_server, admin_sock))

        async def serve_all() -> None:
            await asyncio.gather(*(server.serve(sockets=[sock]) for server, sock in serving))

        self._thread = threading.Thread(target=lambda: asyncio.run(serve_all()), daemon=True)

    def start(self) -> ServerThread:
        self._thread.start()
        try:
            wait_ready(self.base_url, engine=self.engine)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.admin_server is not None:
            self.admin_server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()

    def stats(self):
        return self.engine.stats

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until no request is in flight and the engine has published idle stats."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.engine.stats
            if self.engine.num_in_flight == 0 and stats.num_running + stats.num_waiting == 0:
                return
            time.sleep(0.05)
        raise TimeoutError("server did not become idle")


def start_subprocess_server(
    model: str, *args: str, port: int | None = None, log_path: Path | None = None
) -> tuple[subprocess.Popen, str]:
    """`pagoda serve` as its own process; returns (process, base_url) once it is ready.
    ``port``: where to listen (a free one by default), e.g. a restarted server's old one.
    ``log_path``: a file for its output, for a server that runs long (a pipe nobody reads
    would fill up and block it); by default a pipe, printed if it fails to start."""
    port = port or free_port()
    cmd = [
        sys.executable, "-m", "inference.server.cli_serve", model,
        "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
        "--disable-uvicorn-access-log", *args,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "a") if log_path is not None else contextlib.nullcontext() as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url, proc=proc)
    except BaseException:
        proc.kill()
        output = proc.communicate(timeout=10)[0]
        print(output if log_path is None else log_path.read_text()[-5000:])
        raise
    return proc, base_url


def child_pids(pid: int) -> list[int]:
    """Live (non-zombie) processes whose parent is ``pid``."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces, so split after its ")".
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            children.append(int(entry.name))
    return children


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process_alive(pid):
            return True
        time.sleep(0.05)
    return not process_alive(pid)


# A request with this seed makes `engine_failing_on_fault_seed`'s engine fail its third step.
FAULT_SEED = 4242


def engine_failing_on_fault_seed(config):
    """Runs in the engine process: a real engine whose step() raises a few steps after a
    request with FAULT_SEED arrives, as when a tensor-parallel worker dies mid-step."""
    from inference.engine_core import default_engine_factory

    engine = default_engine_factory(config)
    step = engine.step
    faulty_steps = []

    def faulty_step():
        if any(r.params.seed == FAULT_SEED for r in engine.requests.values()):
            faulty_steps.append(1)
            if len(faulty_steps) >= 3:
                raise RuntimeError("worker 1 died (injected fault)")
        return step()

    engine.step = faulty_step
    return engine


# `engine_capturing_in_background`'s capture ends once the engine ran this many steps.
STEPS_DURING_CAPTURE = 5


def engine_capturing_in_background(config):
    """Runs in the engine process: a real engine whose runner acts as if it had CUDA graphs
    up to its start-up limits. A change past them "records" the missing graphs on the
    capture thread (``inference.reconfigure``), done only once the engine has run
    STEPS_DURING_CAPTURE steps after the capture started: it completes only if steps go
    on meanwhile (after 60 s without them it fails, and the change is refused)."""
    from inference.engine_core import default_engine_factory

    engine = default_engine_factory(config)
    engine.runner = _BackgroundGraphsRunner(engine)
    return engine


class _BackgroundGraphsRunner:
    def __init__(self, engine) -> None:
        self._runner = engine.runner
        self.limits = (engine.config.max_num_seqs, engine.config.max_num_batched_tokens)
        self.steps = 0
        step = engine.step

        def counted_step():
            self.steps += 1
            return step()

        engine.step = counted_step

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def graph_limits(self):
        return self.limits

    def capture_missing_graphs(self, max_num_seqs, max_num_batched_tokens):
        return _StepCountingCapture(self, (max_num_seqs, max_num_batched_tokens))


class _StepCountingCapture:
    num_graphs = 4

    def __init__(self, runner: _BackgroundGraphsRunner, limits: tuple[int, int]) -> None:
        self.runner, self.limits = runner, limits
        self.cancelled = threading.Event()

    def run(self) -> None:
        until = self.runner.steps + STEPS_DURING_CAPTURE
        deadline = time.monotonic() + 60
        while self.runner.steps < until:
            if self.cancelled.is_set():
                raise RuntimeError("cancelled")
            if time.monotonic() > deadline:
                raise RuntimeError("no steps ran during the capture")
            time.sleep(0.01)

    def cancel(self) -> None:
        self.cancelled.set()

    def install(self) -> None:
        self.runner.limits = self.limits
