"""``python -m benchmarks.cold_start``: time from ``pagoda serve`` to a ready server.

Each run starts a real server process (``python -m inference.cli serve MODEL ...``), polls
``/ready`` and records the wall time, the engine's start-up phases as it logs them
(``start-up by phase: {...}``) and the time at which the engine reported them, then stops
the server. Runs share one compiled-kernel cache directory (``TRITON_CACHE_DIR``): the
first run of a fresh directory compiles every kernel (a pod's first start), the next ones
load them (a restart with the cache on the model volume, as the operator mounts it).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from inference.bench.common import record, write_json
from inference.model_shapes import SHAPES, resolve_shape_model

_PHASES = re.compile(r"start-up by phase: (\{.*\})")


def add_cold_start_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", nargs="+", default=["qwen2.5-1.5b"],
                        help="model folders or named shapes (random weights)")
    parser.add_argument("--runs", type=int, default=2,
                        help="starts per model sharing one kernel cache (the first is cold)")
    parser.add_argument("--cache-dir", default=None,
                        help="kernel cache directory (default: a fresh temporary one per model)")
    parser.add_argument("--port", type=int, default=8021)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--log-dir", default=None, help="keep each server's log here")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("serve_args", nargs=argparse.REMAINDER,
                        help="more `pagoda serve` flags, after --")
    return parser


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _timestamp_lines(stream, log, t0: float) -> None:
    for line in stream:
        if "GET /ready" not in line:
            log.write(f"[{time.perf_counter() - t0:7.2f}] {line}")
            log.flush()


def start_once(model: str, port: int, cache_dir: str, serve_args: list[str], timeout: float,
               log_path: Path) -> dict:
    """One server start, from the launch to the first 200 of /ready."""
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "inference.cli", "serve", model, "--host", "127.0.0.1",
           "--port", str(port), *serve_args]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                text=True)
        # Each line of the server's log with the seconds since the launch: the timeline.
        threading.Thread(target=_timestamp_lines, args=(proc.stdout, log, t0),
                         daemon=True).start()
        try:
            while not _ready(port):
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited {proc.returncode}; see {log_path}")
                if time.perf_counter() - t0 > timeout:
                    raise TimeoutError(f"not ready in {timeout:.0f} s; see {log_path}")
                time.sleep(0.05)
            ready_s = time.perf_counter() - t0
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    time.sleep(0.2)  # the last lines of the log
    match = _PHASES.search(log_path.read_text())
    phases = ast.literal_eval(match.group(1)) if match else {}
    return {"ready_s": round(ready_s, 2), "phases": phases}


def _model_folder(model: str) -> tuple[str, list[str]]:
    """A named shape is written once as a folder (config.json and a tokenizer of its
    vocabulary) and served from there with random weights, as a model on disk would be,
    so that the timed start does not include making the synthetic tokenizer."""
    if model not in SHAPES:
        return model, []
    folder, _ = resolve_shape_model(model, with_tokenizer=True)
    return folder, ["--tokenizer", str(Path(folder) / "tokenizer"), "--load-format", "dummy"]


def run_cold_start(args: argparse.Namespace) -> int:
    serve_args = [a for a in args.serve_args if a != "--"]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="cold-start-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for model in args.model:
        cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="triton-cache-")
        target, extra_args = _model_folder(model)
        for run in range(args.runs):
            name = re.sub(r"[^A-Za-z0-9._-]", "_", Path(model).name)
            row = start_once(target, args.port, cache_dir, [*extra_args, *serve_args],
                             args.timeout, log_dir / f"{name}-{run}.log")
            kind = "cold kernel cache" if run == 0 and not args.cache_dir else "warm kernel cache"
            print(f"{model}: run {run} ({kind}): ready in {row['ready_s']:.2f} s "
                  f"{row['phases']}", flush=True)
            results.append(record("cold_start", model=model, run=run, kernel_cache=kind,
                                  serve_args=" ".join(serve_args), **row))
    write_json(args.output_json, results)
    return 0


if __name__ == "__main__":
    parser = add_cold_start_args(argparse.ArgumentParser(prog="cold_start"))
    raise SystemExit(run_cold_start(parser.parse_args()))
