"""FP8 KV cache: the cache writes (alone and fused with rotary) and paged attention over
float8_e4m3fn caches with per-layer scales, Triton kernels vs their references and a
float64 ground truth.

A write must store exactly the bytes of ``quantize_kv_ref`` (divide by the scale in
float32, saturate to +-448, round to nearest even: what the GPU's ``cvt.rn.satfinite``
does, and what the interpreter does once ``kernels._triton`` routes its e4m3 casts
through torch). Attention reads the cache exactly (every e4m3 value times a float32
scale is representable), so it is checked against float64 attention over the same
dequantized cache with the query dtype's usual tolerance: the FP8 error is in what was
stored, not in how it is read.
"""

import pytest
import torch
from test_attention import TOLERANCE, make_batch
from test_elementwise import cos_sin_cache, paged_slots, qkv_views

from pagoda_kernels import (
    paged_attention,
    paged_attention_ref,
    rotary_embedding_with_kv_cache,
    rotary_embedding_with_kv_cache_ref,
    write_kv_cache,
    write_kv_cache_ref,
)
from pagoda_kernels._float64 import attention64, rel_err
from pagoda_kernels.kv_cache import FP8_KV_DTYPE, FP8_KV_MAX, dequantize_kv_ref, quantize_kv_ref


def scale(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32)


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))


def test_quantize_saturates_and_rounds_to_nearest() -> None:
    x = torch.tensor([1000.0, -1e6, 447.0, 0.0, 1.0625, 3.0])
    stored = quantize_kv_ref(x, scale(1.0)).float()
    assert stored.tolist() == [448.0, -448.0, 448.0, 0.0, 1.0, 3.0]  # 1.0625: tie to even
    assert quantize_kv_ref(x, scale(4.0)).float()[5].item() == 0.75
    assert dequantize_kv_ref(quantize_kv_ref(x, scale(4.0)), scale(4.0))[5].item() == 3.0
    # A cache in the model's dtype ignores scales.
    assert torch.equal(dequantize_kv_ref(x, scale(4.0)), x)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(("k_scale", "v_scale"), [(1.0, 1.0), (0.02, 0.005)])
def test_write_kv_cache_fp8(block_size: int, k_scale: float, v_scale: float) -> None:
    torch.manual_seed(block_size)
    num_tokens, num_kv_heads, head_size = 7, 2, 64
    num_blocks = max(3, 2 * num_tokens // block_size)
    # Wide values: some exceed 448 x scale (they saturate), some are subnormal.
    key = (torch.randn(num_tokens, num_kv_heads, head_size) * 4).bfloat16()
    value = (torch.randn(num_tokens, num_kv_heads, head_size) * 2).bfloat16()
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 1e-3, 0.0])
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache = torch.randn(shape).to(FP8_KV_DTYPE)
    v_cache = torch.randn(shape).to(FP8_KV_DTYPE)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    slots = paged_slots(num_tokens, num_blocks * block_size)
    scales = (scale(k_scale), scale(v_scale))
    write_kv_cache(key, value, k_cache, v_cache, slots, *scales)
    write_kv_cache_ref(key, value, k_expected, v_expected, slots, *scales)
    assert_same_bytes(k_cache, k_expected)  # skipped slots keep their old bytes
    assert_same_bytes(v_cache, v_expected)
    first = k_cache.view(-1, num_kv_heads, head_size)[slots[0]] if slots[0] >= 0 else None
    assert first is None or first.float()[0, 0].item() == FP8_KV_MAX  # saturated, not NaN
    assert not k_cache.float().isnan().any() and not v_cache.float().isnan().any()


@pytest.mark.parametrize("block_size", [1, 16])
def test_rotary_embedding_with_fp8_kv_cache(block_size: int) -> None:
    torch.manual_seed(block_size + 1)
    num_tokens, num_kv_heads, head_size = 6, 2, 64
    num_blocks = max(4, 2 * num_tokens // block_size)
    q, k, v = qkv_views(num_tokens, 4, num_kv_heads, head_size, torch.bfloat16)
    cache = cos_sin_cache(32, head_size)
    positions = torch.randint(0, 32, (num_tokens,))
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache, v_cache = (torch.zeros(shape, dtype=FP8_KV_DTYPE) for _ in range(2))
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    slots = paged_slots(num_tokens, num_blocks * block_size)
    k_scale, v_scale = scale(0.01), scale(0.02)
    expected_q, expected_k = rotary_embedding_with_kv_cache_ref(
        positions, q.clone(), k.clone(), v, cache, k_expected, v_expected, slots, k_scale, v_scale
    )
    out_q, out_k = rotary_embedding_with_kv_cache(
        positions, q, k, v, cache, k_cache, v_cache, slots, k_scale, v_scale
    )
    assert rel_err(out_q, expected_q) <= 1e-2 and rel_err(out_k, expected_k) <= 1e-2
    # The cache holds exactly the kernel's own rotated keys, quantized (the rotation may
    # round differently from the reference's in the last bf16 bit under the interpreter).
    k_expected.zero_()
    v_expected.zero_()
    write_kv_cache_ref(out_k, v, k_expected, v_expected, slots, k_scale, v_scale)
    assert_same_bytes(k_cache, k_expected)
    assert_same_bytes(v_cache, v_expected)


def fp8_batch(query_lens, context_lens, num_heads, num_kv_heads, head_size, block_size,
              dtype, k_scale: float, v_scale: float, **kwargs):  # fmt: skip
    """``make_batch`` with its caches quantized as the engine would write them."""
    batch = make_batch(query_lens, context_lens, num_heads, num_kv_heads, head_size,
                       block_size, dtype, **kwargs)  # fmt: skip
    # Keys with a magnitude a real model has (a few units to tens), under a scale that
    # maps them into e4m3's range.
    batch["k_cache"] = quantize_kv_ref(batch["k_cache"].float() * 8, scale(k_scale))
    batch["v_cache"] = quantize_kv_ref(batch["v_cache"].float() * 3, scale(v_scale))
    batch["k_scale"], batch["v_scale"] = scale(k_scale), scale(v_scale)
    return batch


def check_fp8(batch: dict, dtype: torch.dtype, **overrides) -> None:
    from pagoda_kernels._triton import attention as triton_attention

    head_scale = batch["q"].shape[-1] ** -0.5
    covered = int(batch["query_start_loc"][-1])
    poisoned = torch.full_like(batch["q"], float("nan"))
    if overrides:
        out = triton_attention.paged_attention(**batch, scale=head_scale, out=poisoned,
                                               **overrides)  # fmt: skip
    else:
        out = paged_attention(**batch, scale=head_scale, out=poisoned)
    out = out[:covered]
    assert not out.isnan().any(), "kernel left output rows unwritten"
    dequantized = {key: value for key, value in batch.items() if key not in ("k_scale",
                                                                             "v_scale")}
    dequantized["k_cache"] = dequantize_kv_ref(batch["k_cache"], batch["k_scale"]).double()
    dequantized["v_cache"] = dequantize_kv_ref(batch["v_cache"], batch["v_scale"]).double()
    truth = attention64(**dequantized, scale=head_scale)[:covered]
    reference = paged_attention_ref(**batch, scale=head_scale)[:covered]
    assert rel_err(out, truth) <= TOLERANCE[dtype]
    assert rel_err(reference, truth) <= TOLERANCE[dtype]
    assert rel_err(out, reference) <= 2 * TOLERANCE[dtype]


FP8_MIXES = {
    "decode": ([1, 1, 1, 1], [1, 17, 40, 70]),
    "prefill": ([19, 5], [19, 5]),
    "chunked": ([8, 3], [40, 20]),
    "mixed": ([1, 12, 1, 0, 5], [33, 12, 2, 9, 30]),
}


@pytest.mark.parametrize("mix", list(FP8_MIXES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_attention_mixes(mix: str, dtype: torch.dtype) -> None:
    torch.manual_seed(len(mix))
    query_lens, context_lens = FP8_MIXES[mix]
    batch = fp8_batch(query_lens, context_lens, 6, 2, 64, 16, dtype, 0.05, 0.02)
    check_fp8(batch, dtype)


def test_fp8_attention_fp16_block_1_head_128() -> None:
    torch.manual_seed(3)
    batch = fp8_batch([1, 9, 1], [24, 30, 7], 4, 4, 128, 1, torch.float16, 0.1, 0.01)
    check_fp8(batch, torch.float16)


@pytest.mark.parametrize("num_segments", [2, 8])
def test_fp8_attention_split_kv_decode(num_segments: int) -> None:
    """The value scale on split partials: the merge must see them already scaled."""
    torch.manual_seed(num_segments)
    batch = fp8_batch([1, 1, 1], [3, 50, 90], 8, 2, 64, 16, torch.bfloat16, 0.05, 0.03)
    check_fp8(batch, torch.bfloat16, num_segments=num_segments, tile_n=16)


def test_fp8_attention_split_kv_prefill_chunk() -> None:
    torch.manual_seed(1)
    batch = fp8_batch([10, 1], [60, 33], 4, 1, 64, 16, torch.float32, 0.05, 0.02)
    check_fp8(batch, torch.float32, num_segments=4, block_m=16, tile_n=16)


def test_fp8_attention_without_scales_reads_scale_one() -> None:
    torch.manual_seed(4)
    batch = fp8_batch([1, 4], [9, 4], 4, 2, 64, 16, torch.float32, 1.0, 1.0)
    del batch["k_scale"], batch["v_scale"]
    out = paged_attention(**batch, scale=0.125)
    assert rel_err(out, paged_attention_ref(**batch, scale=0.125)) <= 2 * TOLERANCE[torch.float32]


def test_fp8_attention_warm_up_compiles_with_the_model_dtype() -> None:
    from pagoda_kernels._triton import attention as triton_attention

    k_cache = torch.zeros(2, 16, 2, 64, dtype=FP8_KV_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    ran = triton_attention.warm_up(k_cache, v_cache, 4, 0.125, 64, True,
                                   q_dtype=torch.bfloat16, k_scale=scale(0.5),
                                   v_scale=scale(0.5))  # fmt: skip
    assert ran and all(tiling.block_q == 1 for tiling in ran)


def test_mismatched_cache_dtypes_are_refused() -> None:
    batch = make_batch([1], [4], 2, 2, 64, 16, torch.float32)
    batch["k_cache"] = batch["k_cache"].to(FP8_KV_DTYPE)
    with pytest.raises(ValueError, match="both be FP8"):
        paged_attention(**batch, scale=0.125)


def test_dispatch_passes_the_scales_to_the_kernel_or_the_reference(monkeypatch) -> None:
    """Each public op hands k_scale/v_scale to the Triton module under the interpreter, and
    runs the reference (same result) with PAGODA_DISABLE_TRITON=1."""
    from pagoda_kernels import _backend

    torch.manual_seed(6)
    batch = fp8_batch([1, 3], [9, 3], 4, 2, 64, 16, torch.float32, 0.05, 0.02)
    seen = []
    for op_file, name in (("attention", "paged_attention"), ("kv_cache", "write_kv_cache"),
                          ("rotary", "rotary_embedding_with_kv_cache")):  # fmt: skip
        triton_module = _backend.triton_module(op_file)
        real = getattr(triton_module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            passed = [*args, *kwargs.values()]
            seen.append((_name, any(x is batch["k_scale"] for x in passed)
                         and any(x is batch["v_scale"] for x in passed)))  # fmt: skip
            return _real(*args, **kwargs)

        monkeypatch.setattr(triton_module, name, spy)
    out = paged_attention(**batch, scale=0.125)
    key = torch.randn(2, 2, 64)
    slots = torch.tensor([0, 5])
    k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
    write_kv_cache(key, key, k_cache, v_cache, slots, batch["k_scale"], batch["v_scale"])
    q, k, v = qkv_views(2, 4, 2, 64, torch.float32)
    rotary_embedding_with_kv_cache(torch.tensor([3, 4]), q, k, v, cos_sin_cache(8, 64),
                                   k_cache, v_cache, slots, batch["k_scale"],
                                   batch["v_scale"])  # fmt: skip
    assert [name for name, _ in seen] == ["paged_attention", "write_kv_cache",
                                          "rotary_embedding_with_kv_cache"]  # fmt: skip
    assert all(scales_passed for _, scales_passed in seen)

    monkeypatch.setenv("PAGODA_DISABLE_TRITON", "1")
    seen.clear()
    reference = paged_attention(**batch, scale=0.125)
    assert not seen
    assert torch.equal(reference, paged_attention_ref(**batch, scale=0.125))
    assert rel_err(out, reference) <= 2 * TOLERANCE[torch.float32]
