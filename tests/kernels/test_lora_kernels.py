"""Batched LoRA shrink/expand (``pagoda_kernels/lora.py``): the Triton kernels under the
interpreter and the reference against float64 ground truth, for steps that mix several
adapters and base-model rows in prefill-like (contiguous) and decode-like (interleaved)
layouts."""

import pytest
import torch

from pagoda_kernels import add_lora, add_lora_ref, lora_expand, lora_shrink

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def lora64(y, x, a, b, slots):
    """y + (x @ A[slot]^T) @ B[slot]^T row by row, in float64 (base rows: y)."""
    out = y.double().clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            out[t] += (x[t].double() @ a[slot].double().T) @ b[slot].double().T
    return out


def _case(num_rows, hidden, width, rank, num_slots, dtype, layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, hidden, generator=g).to(dtype)
    a = (torch.randn(num_slots, rank, hidden, generator=g) / hidden**0.5).to(dtype)
    b = torch.randn(num_slots, width, rank, generator=g).to(dtype)
    y = torch.randn(num_rows, width, generator=g).to(dtype)
    if layout == "decode":  # rows interleave adapters and the base model
        slots = torch.arange(num_rows) % (num_slots + 1) - 1
    else:  # three sequences: one slot each, then a base-model one
        cut = [0, num_rows // 3, 2 * num_rows // 3, num_rows]
        slots = torch.empty(num_rows, dtype=torch.int64)
        for i, value in enumerate([num_slots - 1, 0, -1]):
            slots[cut[i] : cut[i + 1]] = value
    return x, a, b, y, slots.to(torch.int32)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["decode", "prefill"])
@pytest.mark.parametrize(
    ("num_rows", "hidden", "width", "rank", "num_slots"),
    # The second splits the shrink's hidden size over programs (few row tiles).
    [(5, 64, 96, 8, 3), (3, 700, 40, 16, 2), (37, 80, 130, 24, 4), (1, 32, 16, 16, 1)],
)
def test_add_lora_matches_float64(num_rows, hidden, width, rank, num_slots, dtype, layout):
    x, a, b, y, slots = _case(num_rows, hidden, width, rank, num_slots, dtype, layout)
    want = lora64(y, x, a, b, slots)
    base = slots < 0
    for fn in (add_lora, add_lora_ref):
        got = fn(y.clone(), x, a, b, slots)
        assert _rel(got, want) < TOLERANCE[dtype], fn.__name__
        assert torch.equal(got[base], y[base]), "base-model rows must be left untouched"


def test_shrink_rows_of_adapters_match():
    x, a, _, _, slots = _case(20, 48, 16, 12, 3, torch.float32, "decode", seed=1)
    got = lora_shrink(x, a, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(got[t], x[t] @ a[slot].T, rtol=1e-5, atol=1e-5)


def test_expand_needs_contiguous_rows():
    x, a, b, y, slots = _case(4, 32, 32, 8, 2, torch.float32, "decode")
    with pytest.raises(ValueError, match="contiguous"):
        lora_expand(lora_shrink(x, a, slots), b, slots, y.T.contiguous().T)


COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton.language.target_info as target_info
from pagoda_kernels._triton import lora

target = GPUTarget("cuda", 90, 32)
def current_target(target=target):
    return target
current_target.__triton_builtin__ = True
target_info.current_target = current_target
ints = {name: "i32" for name in ("num_rows", "rank", "hidden", "chunk", "width", "stride_x",
        "stride_al", "stride_ak", "stride_o", "stride_s", "stride_bl", "stride_bn", "stride_y")}
cases = [
    (lora._shrink_kernel, {"x_ptr": "*bf16", "a_ptr": "*bf16", "slot_ptr": "*i32",
     "out_ptr": "*fp32"}, {"BLOCK_M": 16, "BLOCK_K": 64, "BLOCK_H": 64, "PRECISION": "tf32",
     "SPLIT": True}),
    (lora._shrink_kernel, {"x_ptr": "*fp32", "a_ptr": "*fp32", "slot_ptr": "*i32",
     "out_ptr": "*fp32"}, {"BLOCK_M": 16, "BLOCK_K": 16, "BLOCK_H": 64, "PRECISION": "ieee",
     "SPLIT": False}),
    (lora._expand_kernel, {"s_ptr": "*fp32", "b_ptr": "*bf16", "slot_ptr": "*i32",
     "y_ptr": "*bf16"}, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32, "PRECISION": "tf32"}),
]
for kernel, pointers, constants in cases:
    names = kernel.arg_names
    signature = {n: pointers.get(n) or ints.get(n) or "constexpr" for n in names}
    consts = {(names.index(k),): v for k, v in constants.items()}
    src = ASTSource(kernel, signature, constexprs=consts)
    ptx = triton.compile(src, target=target, options={"num_warps": 4, "launch_pdl": True}).asm["ptx"]
    print(kernel.__name__, "griddepcontrol.wait" in ptx, "mma" in ptx)
"""


def test_kernels_compile_for_hopper():
    """The compiled path (not the interpreter) for an H200: early exit, split-K atomics and
    the dot all lower, bf16 on tensor cores (float32 in IEEE precision: FMA)."""
    from hopper_compile import run_compile_script

    done = run_compile_script(COMPILE_SCRIPT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:3] == [
        "_shrink_kernel True True", "_shrink_kernel True False", "_expand_kernel True True"]
