"""KV-cache write, RMSNorm, rotary (alone and fused with the cache write) and SiLU-and-mul:
Triton kernels vs their references and float64 ground truth, on poisoned outputs."""

import pytest
import torch

from pagoda_kernels import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
    rotary_embedding,
    rotary_embedding_ref,
    rotary_embedding_with_kv_cache,
    rotary_embedding_with_kv_cache_ref,
    silu_and_mul,
    silu_and_mul_ref,
    write_kv_cache,
    write_kv_cache_ref,
)
from pagoda_kernels._float64 import rel_err, rms_norm64, rotary64, silu_and_mul64

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]


def cos_sin_cache(max_position: int, head_size: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_size, 2).float() / head_size))
    angles = torch.arange(max_position).float()[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def paged_slots(num_tokens: int, num_slots: int) -> torch.Tensor:
    """Distinct random slots with every third token marked as padding (-1)."""
    assert num_slots >= num_tokens
    slots = torch.randperm(num_slots)[:num_tokens]
    slots[::3] = -1
    return slots


@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("cache_dtype", DTYPES)
def test_write_kv_cache(block_size: int, cache_dtype: torch.dtype) -> None:
    torch.manual_seed(block_size)
    num_tokens, num_kv_heads, head_size = 7, 2, 64
    num_blocks = max(3, 2 * num_tokens // block_size)
    key = torch.randn(num_tokens, num_kv_heads, head_size)
    value = torch.randn(num_tokens, num_kv_heads, head_size)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache, v_cache = torch.randn(shape).to(cache_dtype), torch.randn(shape).to(cache_dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    slots = paged_slots(num_tokens, num_blocks * block_size)
    write_kv_cache(key, value, k_cache, v_cache, slots)
    write_kv_cache_ref(key, value, k_expected, v_expected, slots)
    # Skipped slots keep their old contents; written ones are copies (exact without a
    # dtype change; the interpreter rounds float32 -> bf16 toward zero, so allow an ulp).
    tolerance = 0.0 if cache_dtype == key.dtype else 2**-7
    for cache, expected in ((k_cache, k_expected), (v_cache, v_expected)):
        assert torch.allclose(cache.float(), expected.float(), rtol=tolerance, atol=0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 256])
def test_rms_norm(dtype: torch.dtype, hidden: int) -> None:
    torch.manual_seed(hidden)
    x = torch.randn(5, hidden).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == rms_norm_ref(x, weight, 1e-6).dtype
    assert rel_err(out, rms_norm64(x, weight, 1e-6)) <= TOLERANCE[dtype]
    assert rel_err(out, rms_norm_ref(x, weight, 1e-6)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    x, residual = torch.randn(4, 3, 160).to(dtype), torch.randn(4, 3, 160).to(dtype)
    weight = (1 + 0.1 * torch.randn(160)).to(dtype)
    expected_out, expected_sum = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    out, summed = fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    assert out.shape == expected_out.shape and summed.dtype == expected_sum.dtype
    # Exact on the GPU; the interpreter rounds float32 -> bf16 toward zero (an ulp off).
    ulp = 0.0 if dtype == torch.float32 else 2**-7
    assert torch.allclose(summed.float(), expected_sum.float(), rtol=ulp, atol=0.0)
    assert rel_err(out, rms_norm64(expected_sum, weight, 1e-5)) <= TOLERANCE[dtype]
    assert rel_err(out, expected_out) <= TOLERANCE[dtype]


def test_fused_add_rms_norm_mixed_dtypes_out_of_place() -> None:
    """A float32 residual stream with bf16 activations: the sum is float32, as in torch."""
    torch.manual_seed(4)
    x, residual = torch.randn(3, 64).bfloat16(), torch.randn(3, 64)
    weight = torch.ones(64).bfloat16()
    expected_out, expected_sum = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    out, summed = fused_add_rms_norm(x, residual.clone(), weight, 1e-6)
    assert out.dtype == expected_out.dtype and summed.dtype == expected_sum.dtype
    assert torch.allclose(summed, expected_sum)
    assert rel_err(out, expected_out) <= 1e-5


def qkv_views(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as strided views into one fused QKV projection output, as the model has."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size).to(dtype)
    kv_size = num_kv_heads * head_size
    q, k, v = qkv.split([num_heads * head_size, kv_size, kv_size], dim=-1)
    return (
        q.view(num_tokens, num_heads, head_size),
        k.view(num_tokens, num_kv_heads, head_size),
        v.view(num_tokens, num_kv_heads, head_size),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "head_size"), [(6, 64), (4, 128)])
def test_rotary_embedding(dtype: torch.dtype, num_heads: int, head_size: int) -> None:
    torch.manual_seed(num_heads)
    q, k, _ = qkv_views(5, num_heads, 2, head_size, dtype)
    cache = cos_sin_cache(64, head_size)
    positions = torch.randint(0, 64, (5,))
    expected_q, expected_k = rotary_embedding_ref(positions, q, k, cache)
    truth_q, truth_k = rotary64(positions, q, cache), rotary64(positions, k, cache)
    out_q, out_k = rotary_embedding(positions, q, k, cache)
    for out, expected, truth in ((out_q, expected_q, truth_q), (out_k, expected_k, truth_k)):
        assert out.shape == expected.shape and out.dtype == expected.dtype
        assert rel_err(out, truth) <= TOLERANCE[dtype]
        assert rel_err(out, expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("block_size", [1, 16])
def test_rotary_embedding_with_kv_cache(block_size: int) -> None:
    torch.manual_seed(block_size)
    num_tokens, num_kv_heads, head_size = 6, 2, 64
    num_blocks = max(4, 2 * num_tokens // block_size)
    q, k, v = qkv_views(num_tokens, 4, num_kv_heads, head_size, torch.bfloat16)
    cache = cos_sin_cache(32, head_size)
    positions = torch.randint(0, 32, (num_tokens,))
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache, v_cache = torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    slots = paged_slots(num_tokens, num_blocks * block_size)
    expected_q, expected_k = rotary_embedding_with_kv_cache_ref(
        positions, q, k, v, cache, k_expected, v_expected, slots
    )
    out_q, out_k = rotary_embedding_with_kv_cache(
        positions, q, k, v, cache, k_cache, v_cache, slots
    )
    assert rel_err(out_q, expected_q) <= 1e-2 and rel_err(out_k, expected_k) <= 1e-2
    assert torch.equal(v_cache, v_expected)
    written = slots[slots >= 0]
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_size)[written], out_k[slots >= 0])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[written] = False
    flat_k, flat_expected = (
        k_cache.view(-1, num_kv_heads, head_size),
        k_expected.view(-1, num_kv_heads, head_size),
    )
    assert torch.equal(flat_k[untouched], flat_expected[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 200), (2, 3, 2304)])
def test_silu_and_mul(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    torch.manual_seed(shape[-1])
    x = torch.randn(shape).to(dtype)
    out = silu_and_mul(x)
    expected = silu_and_mul_ref(x)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert rel_err(out, silu_and_mul64(x)) <= TOLERANCE[dtype]
    assert rel_err(out, expected) <= TOLERANCE[dtype]
