"""Long prefills through SDPA (``pagoda_kernels.attention.LongPrefill``): a step whose
chosen sequences run torch's SDPA over their context gathered from the cache, and the
others the paged kernel (Triton under the interpreter here), gives the float64 truth.
The chosen sequences sit first, last, side by side and between others; a prefill chunk
over earlier context and a prefix-cache hit need the causal mask aligned to the last key
(top-left alignment, SDPA's ``is_causal`` for non-square scores, would be wrong)."""

import numpy as np
import pytest
import torch
from test_attention import TOLERANCE, make_batch
from test_fp8_kv_cache import fp8_batch

from pagoda_kernels import paged_attention
from pagoda_kernels._float64 import attention64, rel_err
from pagoda_kernels.attention import LongPrefill, _sdpa_prefill, _SdpaMode, find_long_prefills
from pagoda_kernels.kv_cache import dequantize_kv_ref

MIN_QUERIES = 8
MIXES = {
    # name: (query lengths, context lengths); the long ones have >= 8 query tokens
    "alone, from scratch": ([40], [40]),
    "alone, a chunk over context": ([24], [61]),
    "last, after decodes": ([1, 1, 1, 30], [9, 33, 2, 70]),
    "first, then decodes and a short chunk": ([17, 1, 5, 1], [17, 40, 25, 3]),
    "side by side, between others": ([1, 12, 9, 0, 3, 20, 1], [5, 12, 50, 4, 10, 36, 18]),
}


def _check(batch: dict, dtype: torch.dtype, truth_batch: dict | None = None) -> None:
    scale = batch["q"].shape[-1] ** -0.5
    prefills = find_long_prefills(batch["query_start_loc"].numpy(), batch["seq_lens"].numpy(),
                                  MIN_QUERIES, 0)  # fmt: skip
    assert prefills
    covered = int(batch["query_start_loc"][-1])
    out = paged_attention(**batch, scale=scale, out=torch.full_like(batch["q"], float("nan")),
                          long_prefills=prefills)  # fmt: skip
    assert not out[:covered].isnan().any(), "rows left unwritten"
    truth = attention64(**(truth_batch or batch), scale=scale)[:covered]
    assert rel_err(out[:covered], truth) <= TOLERANCE[dtype]


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("block_size", [1, 16])
def test_long_prefills_beside_the_paged_kernel(mix: str, block_size: int) -> None:
    torch.manual_seed(block_size + len(mix))
    batch = make_batch(*MIXES[mix], 6, 2, 64, block_size, torch.float32, padding_tokens=3)
    _check(batch, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 1), (2, 2)])
def test_long_prefill_dtypes_and_groups(dtype, num_heads: int, num_kv_heads: int) -> None:
    torch.manual_seed(num_heads)
    batch = make_batch([1, 19, 2], [7, 50, 20], num_heads, num_kv_heads, 128, 16, dtype)
    _check(batch, dtype)


def test_long_prefill_over_an_fp8_cache() -> None:
    torch.manual_seed(5)
    batch = fp8_batch([1, 21, 1], [30, 45, 3], 4, 2, 64, 16, torch.bfloat16, 0.02, 0.005)
    truth = {key: value for key, value in batch.items() if key not in ("k_scale", "v_scale")}
    truth["k_cache"] = dequantize_kv_ref(batch["k_cache"], batch["k_scale"]).double()
    truth["v_cache"] = dequantize_kv_ref(batch["v_cache"], batch["v_scale"]).double()
    _check(batch, torch.bfloat16, truth)


def test_long_prefills_are_found_from_the_host_arrays() -> None:
    query_start_loc = np.array([0, 1, 13, 22, 22, 25, 45], dtype=np.int32)
    seq_lens = np.array([5, 12, 50, 4, 10, 36], dtype=np.int32)
    assert find_long_prefills(query_start_loc, seq_lens, 9, 0) == (
        LongPrefill(1, 1, 12, 12), LongPrefill(2, 13, 9, 50), LongPrefill(5, 25, 20, 36))
    assert find_long_prefills(query_start_loc, seq_lens, 13, 0) == (LongPrefill(5, 25, 20, 36),)
    # Queries x context: 144, 450 and 720 pairs.
    assert find_long_prefills(query_start_loc, seq_lens, 9, 450) == (
        LongPrefill(2, 13, 9, 50), LongPrefill(5, 25, 20, 36))
    assert find_long_prefills(query_start_loc, seq_lens, None, 0) == ()
    # On a GPU: a 32k chunk over 32k of context (2^30 pairs) does not overflow.
    big = find_long_prefills(np.array([0, 32768], dtype=np.int32),
                             np.array([65536], dtype=np.int32), 2048)
    assert big == (LongPrefill(0, 0, 32768, 65536),)
    assert find_long_prefills(np.array([0, 4096], dtype=np.int32),
                              np.array([4096], dtype=np.int32), 2048) == ()


@pytest.mark.parametrize("over_context", ["cpu", "lower_right"])
@pytest.mark.parametrize("expand_kv", [False, True])
def test_each_way_sdpa_may_run(over_context: str, expand_kv: bool) -> None:
    """A chunk over earlier context as one lower-right call or as two fused calls merged by
    their log-sum-exps; the KV heads as they are or expanded for the group."""
    torch.manual_seed(9)
    batch = make_batch([1, 19, 2], [7, 50, 20], 6, 2, 64, 16, torch.float32)
    scale = 64**-0.5
    rows = slice(1, 20)
    truth = attention64(**batch, scale=scale)[rows]
    for context_len, query in ((50, batch["q"][rows]), (19, batch["q"][rows])):
        out = torch.empty_like(query)
        _sdpa_prefill(query, batch["k_cache"], batch["v_cache"], batch["block_tables"][1],
                      context_len, scale, None, None, out, _SdpaMode(expand_kv, over_context))
        if context_len == 50:
            assert rel_err(out, truth) <= TOLERANCE[torch.float32]
        else:  # from scratch: the first 19 keys of its blocks, causal
            first = {**batch, "seq_lens": torch.tensor([7, 19, 20], dtype=torch.int32)}
            assert rel_err(out, attention64(**first, scale=scale)[rows]) <= 1e-4


def test_the_sdpa_mode_is_checked_against_the_reference(monkeypatch) -> None:
    """SDPA is checked once per shape before any step uses it, each way in turn (here:
    the split around the CPU's fused op, then one lower-right call; GQA as it is, else
    expanded), a wrong result counting as failing; none working means the paged kernel."""
    import pagoda_kernels.attention as attention

    cpu = torch.device("cpu")
    args = (cpu, torch.float32, 4, 2, 32)
    attention._sdpa_mode.cache_clear()
    assert attention._sdpa_mode(*args) == _SdpaMode(False, "cpu")
    real = attention._sdpa_prefill

    def only(mode):
        def run(*given):
            if given[-1] != mode:
                raise RuntimeError("No available kernel")
            real(*given)
        return run

    for mode in (_SdpaMode(True, "cpu"), _SdpaMode(False, "lower_right")):
        attention._sdpa_mode.cache_clear()
        monkeypatch.setattr(attention, "_sdpa_prefill", only(mode))
        assert attention._sdpa_mode(*args) == mode

    def wrong(*given):
        real(*given)
        given[-2].add_(1.0)  # ``out``

    attention._sdpa_mode.cache_clear()
    monkeypatch.setattr(attention, "_sdpa_prefill", wrong)
    assert attention._sdpa_mode(*args) is None
    attention._sdpa_mode.cache_clear()
    assert attention.long_prefill_min_queries(cpu, *args[1:]) is None  # never on CPU


def test_a_long_prefill_sdpa_fails_on_runs_the_paged_kernel(monkeypatch) -> None:
    """A limit the start-up check's small probe did not meet fails one call: that sequence
    runs the paged kernel, and the step's result is the same."""
    import pagoda_kernels.attention as attention

    def failing(*args):
        raise RuntimeError("cuDNN: sequence too long")

    attention._sdpa_mode(torch.device("cpu"), torch.float32, 6, 2, 64)  # checked, cached
    monkeypatch.setattr(attention, "_sdpa_prefill", failing)
    torch.manual_seed(3)
    batch = make_batch(*MIXES["side by side, between others"], 6, 2, 64, 16, torch.float32)
    _check(batch, torch.float32)
