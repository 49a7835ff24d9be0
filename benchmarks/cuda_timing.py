"""GPU time of a call as the engine's CUDA graphs see it, for the kernel sweeps
(``gemv_check``, ``gemv_check --fp8``): launch overhead excluded."""

import statistics
from collections.abc import Callable
from typing import Any

import torch


def graph_us(calls: list[Callable[[], Any]], min_launches: int = 128) -> float:
    """GPU microseconds a call: the rotated calls captured (repeated) in one CUDA graph,
    replayed 5 times, median of event-timed replays. Launch overhead is excluded, as in
    the engine's decode graphs."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    reps = max(1, -(-min_launches // len(calls)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for call in calls:
                call()
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times) * 1e3 / (reps * len(calls))
