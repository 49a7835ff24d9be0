"""Where a serving latency tail comes from: the slowest requests of a ``pagoda bench serve
--save-detailed`` run beside the engine steps (``PAGODA_STEP_TRACE``) that ran while they
waited. Both files use wall-clock times of the same machine.

    python -m benchmarks.serve_trace RESULT.json STEPS.csv [--top 8]

If a slow request's wait is covered by long steps, the engine is the cause (a compile, a
big prefill, a stalled GPU); if the steps around it are short, the time went in the
server, the pipe between the processes or the client.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys


def load_steps(path: str) -> list[dict[str, float]]:
    with open(path) as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="serve_trace")
    parser.add_argument("result_json")
    parser.add_argument("steps_csv")
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args(argv)

    result = json.load(open(args.result_json))
    requests = [r for r in result.get("requests", []) if r["ok"]]
    if not requests:
        print("no per-request data: run pagoda bench serve with --save-detailed")
        return 1
    first = min(r["start_time"] for r in requests)
    last = max(r["start_time"] + r["e2e_ms"] / 1e3 for r in requests)
    steps = [s for s in load_steps(args.steps_csv) if first <= s["start_s"] <= last]
    step_ms = sorted(s["step_ms"] for s in steps)
    send_ms = sorted(s["send_ms"] for s in steps)

    def pct(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else 0.0

    print(f"{len(steps)} engine steps during the run: step ms p50 {pct(step_ms, 50):.2f} "
          f"p99 {pct(step_ms, 99):.2f} max {pct(step_ms, 100):.2f}; send ms p99 "
          f"{pct(send_ms, 99):.2f} max {pct(send_ms, 100):.2f}; "
          f"{sum(ms > 20 for ms in step_ms)} steps over 20 ms")
    if steps and "cpu_ms" in steps[0]:  # the loop thread: computing, or waiting/preempted?
        wall = sum(s["step_ms"] + s["send_ms"] for s in steps)
        cpu = sum(s["cpu_ms"] for s in steps)
        print(f"engine loop thread: CPU {cpu:.0f} ms of {wall:.0f} ms of steps "
              f"({cpu / max(wall, 1e-9):.0%}); preempted {sum(s['preempted'] for s in steps):.0f} "
              "times (involuntary context switches)")
    if steps and "device_wait_ms" in steps[0]:
        wait = sum(s["device_wait_ms"] for s in steps)
        print(f"of the steps' {sum(s['step_ms'] for s in steps):.0f} ms, {wait:.0f} ms waiting "
              "for the device, the rest host work")
    print(f"{'t (s)':>8} {'TTFT ms':>8} {'max gap':>8} | steps meanwhile: {'n':>4} "
          f"{'sum ms':>8} {'max ms':>7} {'max run':>7} {'max wait':>8}")
    requests.sort(key=lambda r: r["ttft_ms"], reverse=True)
    for r in requests[: args.top]:
        start = r["start_time"]
        end = start + r["ttft_ms"] / 1e3
        during = [s for s in steps if start <= s["start_s"] + s["step_ms"] / 1e3 and s["start_s"] <= end]
        gap = max(r["itl_ms"], default=0.0)
        print(f"{start - first:8.3f} {r['ttft_ms']:8.1f} {gap:8.1f} | {'':17}{len(during):>4} "
              f"{sum(s['step_ms'] for s in during):8.1f} "
              f"{max((s['step_ms'] for s in during), default=0):7.1f} "
              f"{max((s['running'] for s in during), default=0):7.0f} "
              f"{max((s['waiting'] for s in during), default=0):8.0f}")
    print("longest steps:")
    for s in sorted(steps, key=lambda s: s["step_ms"], reverse=True)[: args.top]:
        print(f"  t {s['start_s'] - first:8.3f} s: {s['step_ms']:8.2f} ms, running "
              f"{s['running']:.0f}, waiting {s['waiting']:.0f}, prompt tokens "
              f"{s['prompt_tokens']:.0f}, output tokens {s['output_tokens']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
