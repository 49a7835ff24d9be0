"""The FP8 GEMV sweep (``python -m benchmarks.gemv_check --fp8``) end to end on CPU:
tiny shapes, the Triton interpreter, a stand-in timer; so the H200 run cannot fail on a
wrong argument, key or JSON field. And its table round trip into ``kernels._gemv_table``."""

import importlib
import json
import sys

import pytest
import torch

from pagoda_kernels import _gemv_table
from pagoda_kernels._gemv_table import FMA_MAX_M, GemvConfig

TINY = {"tiny": {"qkv": (40, 96, True)}}


@pytest.fixture
def sweep(monkeypatch: pytest.MonkeyPatch):
    from benchmarks import gemv_fp8

    monkeypatch.setattr(gemv_fp8, "DEVICE", torch.device("cpu"))
    monkeypatch.setattr(gemv_fp8, "SHAPES", TINY)
    monkeypatch.setattr(gemv_fp8, "ROTATE_BYTES", 1)  # two weight sets
    monkeypatch.setattr(gemv_fp8, "results", {"checks": [], "sweep": [], "best": [], "graph": []})
    full = gemv_fp8.candidates

    def one_per_kind(m, n, k, sms):  # every kind and split-K, few interpreter launches
        configs = full(m, n, k, sms)
        assert {c.kind for c in configs} == {"fma", "fmaq", "dot", "dotq"}
        return [GemvConfig("fma", 8, 64, 2), GemvConfig("fmaq", 8, 128),
                GemvConfig("dot", 16, 64), GemvConfig("dotq", 32, 32, 2)]  # fmt: skip

    monkeypatch.setattr(gemv_fp8, "candidates", one_per_kind)
    # One "SM": the dispatched configs take few, wide row blocks (few interpreted programs).
    for module in ("pagoda_kernels.fp8_linear", "pagoda_kernels.linear"):
        monkeypatch.setattr(importlib.import_module(module), "num_sms", lambda device: 1)
    timings = {"fma": 3.0, "fmaq": 2.0, "dot": 5.0, "dotq": 4.0}

    def fake_time_us(calls):  # the kind a timed call ran, or a rival path: 10 us
        fake_time_us.kind = None
        for call in calls:
            call()
        return timings.get(fake_time_us.kind, 10.0)

    monkeypatch.setattr(gemv_fp8, "time_us", fake_time_us)
    # Which kind a timed call runs: read from the config the sweep passes.
    from pagoda_kernels._triton import fp8_linear as triton_fp8

    original = triton_fp8.fp8_linear

    def tagged(x, w, s, b, config, out=None):
        fake_time_us.kind = config.kind
        return original(x, w, s, b, config, out)

    monkeypatch.setattr(triton_fp8, "fp8_linear", tagged)
    return gemv_fp8


def test_sweep_runs_end_to_end(sweep, tmp_path, monkeypatch, capsys) -> None:
    from benchmarks import gemv_check

    path = tmp_path / "fp8_sweep.json"
    argv = ["gemv_check", "--fp8", "--out", str(path), "--workers", "0", "--fp8-ms", "1", "3"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit):  # 3 is not a swept M
        gemv_check.main()
    argv[-1] = "2"
    gemv_check.main()
    data = json.loads(path.read_text())
    assert not data.get("errors"), data.get("errors")
    assert data["checks"] and all(c["ok"] for c in data["checks"]), data["checks"]
    assert len(data["best"]) == 2  # M in (1, 2)
    for row in data["best"]:
        assert row["bf16_us"] and row["shipped_us"] and row["tried"] == 4
        assert set(row["by_kind"]) == {"fma", "fmaq", "dot", "dotq"}
        assert row["best"]["kind"] == "fmaq"  # the stand-in timer's fastest
    assert {r["config"] for r in data["sweep"]} >= {"fma:n8k64s2w4st1", "dotq:n32k32s2w4st1"}
    table = _gemv_table.fp8_table_from_sweep(data)
    assert set(table) == {(40, 96)}
    assert [m for m, _ in table[(40, 96)]] == [1, 2]
    assert [(r["model"], r["m"], r["best_us"]) for r in data["layers"]] == [
        ("tiny", 1, 2.0), ("tiny", 2, 2.0)]  # the one projection, fmaq's stand-in time  # fmt: skip
    printed = capsys.readouterr().out
    assert "FP8_TABLE entries" in printed and "tiny qkv" in printed


def test_candidates_on_the_real_shapes() -> None:
    """Few enough for the time budget, every kind, tiles within K, split-K slices that
    are not empty."""
    from benchmarks import gemv_fp8

    total = 0
    for projections in gemv_fp8.SHAPES.values():
        for n, k, _ in projections.values():
            for m in gemv_fp8.MS:
                configs = gemv_fp8.candidates(m, n, k, 132)
                total += len(configs)
                assert {c.kind for c in configs} == {"fma", "fmaq", "dot", "dotq"}
                assert len(set(configs)) == len(configs) <= 34
                for config in configs:
                    assert config.split_k == 1 or config.split_k * config.block_k <= k
    assert total <= 850  # ~3 min on one H200, compiles included


def test_fp8_table_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    sweep = {"fp8_table": {"4608,3584": [[2, GemvConfig("dot", 64, 256, 2, 4, 3).__dict__],
                                         [1, GemvConfig("fma", 4, 512).__dict__],
                                         [8, None]]}}  # fmt: skip
    table = _gemv_table.fp8_table_from_sweep(sweep)
    assert table == {(4608, 3584): [(1, GemvConfig("fma", 4, 512)),
                                    (2, GemvConfig("dot", 64, 256, 2, 4, 3)), (8, None)]}  # fmt: skip
    source = _gemv_table.table_source(table)
    assert eval("{" + source + "}", {"GemvConfig": GemvConfig}) == table
    monkeypatch.setattr(_gemv_table, "FP8_TABLE", table)
    assert _gemv_table.lookup_fp8(1, 4608, 3584, 132) == GemvConfig("fma", 4, 512)
    assert _gemv_table.lookup_fp8(2, 4608, 3584, 132).kind == "dot"
    assert _gemv_table.lookup_fp8(3, 4608, 3584, 132) is None  # cuBLASLt measured faster
    assert _gemv_table.lookup_fp8(1, 3584, 3584, 132) == _gemv_table.fp8_heuristic(
        1, 3584, 3584, 132)  # a shape not in the table  # fmt: skip


@pytest.mark.parametrize("m", range(1, FMA_MAX_M + 1))
@pytest.mark.parametrize(("n", "k"), [(4608, 3584), (3584, 18944), (1536, 1536), (40, 70)])
def test_fp8_heuristic_is_valid(m, n, k) -> None:
    config = _gemv_table.fp8_heuristic(m, n, k, 132)
    assert config.kind in ("fma", "fmaq", "dot", "dotq")
    assert config.split_k == 1 or config.split_k * config.block_k <= k
