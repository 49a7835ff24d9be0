"""Sharding of the GPU suite over the GPUs of one machine (``tests/gpu/run_suite.sh``).

``PAGODA_GPU_SHARD=i/n`` keeps every n-th collected test starting at the i-th, so n pytest
processes, each with its own ``CUDA_VISIBLE_DEVICES``, split the suite between them; the
engine start-ups (weights, KV sizing, CUDA-graph capture) are most of its time, so n GPUs
take about 1/n of it. Unset, every test runs.
"""

from __future__ import annotations

import os

import pytest


def _shard() -> tuple[int, int] | None:
    value = os.environ.get("PAGODA_GPU_SHARD")
    if not value:
        return None
    index, _, count = value.partition("/")
    shard = (int(index), int(count))
    if not 0 <= shard[0] < shard[1]:
        raise pytest.UsageError(f"PAGODA_GPU_SHARD={value!r}: want i/n with 0 <= i < n")
    return shard


@pytest.hookimpl(trylast=True)  # after -k/-m deselection, so shards stay even
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    shard = _shard()
    if shard is None:
        return
    index, count = shard
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    deselected = [item for i, item in enumerate(gpu_items) if i % count != index]
    if deselected:
        drop = set(map(id, deselected))
        items[:] = [item for item in items if id(item) not in drop]
        config.hook.pytest_deselected(items=deselected)
