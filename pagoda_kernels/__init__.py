"""Ops the engine calls, one op a file.

Every op has a plain-torch reference (``*_ref``) with the same signature as the public
function. The public function picks the Triton kernel when its inputs live on a CUDA
device (or when ``TRITON_INTERPRET=1`` asks for the interpreter) and the reference
otherwise. Tests compare every kernel against its reference.
"""

from pagoda_kernels.activation import (
    silu_and_mul,
    silu_and_mul_fp8,
    silu_and_mul_fp8_ref,
    silu_and_mul_ref,
)
from pagoda_kernels.attention import paged_attention, paged_attention_ref, warm_up_paged_attention
from pagoda_kernels.fp8_linear import MAX_M as FP8_SKINNY_MAX_M
from pagoda_kernels.fp8_linear import fp8_linear, fp8_linear_ref, wants_fp8_input
from pagoda_kernels.fp8_quant import Fp8Activations
from pagoda_kernels.int4_linear import int4_linear, int4_linear_ref
from pagoda_kernels.kv_cache import write_kv_cache, write_kv_cache_ref
from pagoda_kernels.linear import (
    linear,
    linear_ref,
    linear_silu_and_mul,
    linear_silu_and_mul_ref,
)
from pagoda_kernels.lora import (
    add_lora,
    add_lora_ref,
    lora_expand,
    lora_expand_ref,
    lora_shrink,
    lora_shrink_ref,
)
from pagoda_kernels.rms_norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_fp8,
    fused_add_rms_norm_fp8_ref,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_fp8,
    rms_norm_fp8_ref,
    rms_norm_ref,
)
from pagoda_kernels.rotary import rotary_embedding, rotary_embedding_ref
from pagoda_kernels.rotary_kv_cache import (
    rotary_embedding_with_kv_cache,
    rotary_embedding_with_kv_cache_ref,
)
from pagoda_kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_ref

__all__ = [
    "FP8_SKINNY_MAX_M",
    "Fp8Activations",
    "apply_token_bitmask",
    "apply_token_bitmask_ref",
    "fp8_linear",
    "fp8_linear_ref",
    "fused_add_rms_norm",
    "fused_add_rms_norm_fp8",
    "fused_add_rms_norm_fp8_ref",
    "fused_add_rms_norm_ref",
    "int4_linear",
    "int4_linear_ref",
    "add_lora",
    "add_lora_ref",
    "linear",
    "linear_ref",
    "linear_silu_and_mul",
    "linear_silu_and_mul_ref",
    "lora_expand",
    "lora_expand_ref",
    "lora_shrink",
    "lora_shrink_ref",
    "paged_attention",
    "paged_attention_ref",
    "rms_norm",
    "rms_norm_fp8",
    "rms_norm_fp8_ref",
    "rms_norm_ref",
    "rotary_embedding",
    "rotary_embedding_ref",
    "rotary_embedding_with_kv_cache",
    "rotary_embedding_with_kv_cache_ref",
    "silu_and_mul",
    "silu_and_mul_fp8",
    "silu_and_mul_fp8_ref",
    "silu_and_mul_ref",
    "write_kv_cache",
    "wants_fp8_input",
    "warm_up_paged_attention",
    "write_kv_cache_ref",
]
