"""Triton LoRA shrink and expand (``pagoda_kernels/lora.py``), segmented by slot without sorting.

The grid has one axis over the adapter slots: program (m, ..., s) takes the rows of its
tile of ``BLOCK_M`` rows whose slot is ``s`` and masks the rest out; a program whose tile
has no row of its slot returns at once. Rows of one sequence are contiguous, so a prefill
tile is (nearly) all one slot and runs as a dense GEMM tile (SGMV); a decode tile mixes
rows of several adapters, each handled by its slot's program (BGMV). Nothing depends on
the host knowing which slots a step uses, so a CUDA graph replays these launches with any
slot indices. Accumulation is in float32; float32 inputs multiply in IEEE precision. A
shrink with few row tiles (decode) also splits the hidden size over programs that add
their partial sums atomically (in any order: the last bits may differ run to run).
"""

import torch
import triton
import triton.language as tl

from pagoda_kernels._backend import num_sms
from pagoda_kernels._triton.pdl import launch_pdl, wait_for_inputs

_BLOCK_M = 16
_SPLIT_MIN_COLUMNS = 256  # a program of a split shrink walks at least this many columns


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, slot_ptr, out_ptr, num_rows, rank, hidden, chunk,
    stride_x, stride_al, stride_ak, stride_o,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
    PRECISION: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    wait_for_inputs()
    slot = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_slots = tl.load(slot_ptr + rows, mask=rows < num_rows, other=-1)
    mine = row_slots == slot
    if tl.max(mine.to(tl.int32), axis=0) == 0:
        return
    rows64 = rows.to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < rank
    a_base = a_ptr + slot.to(tl.int64) * stride_al
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    first = tl.program_id(2) * chunk
    for start in range(first, first + chunk, BLOCK_H):
        hs = start + tl.arange(0, BLOCK_H)
        h_ok = hs < hidden
        x = tl.load(x_ptr + rows64[:, None] * stride_x + hs[None, :],
                    mask=mine[:, None] & h_ok[None, :], other=0.0)  # fmt: skip
        a = tl.load(a_base + ks[None, :] * stride_ak + hs[:, None],
                    mask=k_ok[None, :] & h_ok[:, None], other=0.0)  # fmt: skip
        acc = tl.dot(x, a, acc, input_precision=PRECISION)
    out_ptrs = out_ptr + rows64[:, None] * stride_o + ks[None, :]
    if SPLIT:  # each program sums its share of the hidden size into the zeroed output
        tl.atomic_add(out_ptrs, acc, mask=mine[:, None] & k_ok[None, :])
    else:
        tl.store(out_ptrs, acc, mask=mine[:, None] & k_ok[None, :])


@triton.jit
def _expand_kernel(
    s_ptr, b_ptr, slot_ptr, y_ptr, num_rows, rank, width,
    stride_s, stride_bl, stride_bn, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    wait_for_inputs()
    slot = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_slots = tl.load(slot_ptr + rows, mask=rows < num_rows, other=-1)
    mine = row_slots == slot
    if tl.max(mine.to(tl.int32), axis=0) == 0:
        return
    rows64 = rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < width
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < rank
    s = tl.load(s_ptr + rows64[:, None] * stride_s + ks[None, :],
                mask=mine[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bl + cols[None, :] * stride_bn + ks[:, None],
                mask=n_ok[None, :] & k_ok[:, None], other=0.0)  # fmt: skip
    delta = tl.dot(s.to(b.dtype), b, input_precision=PRECISION)
    y_ptrs = y_ptr + rows64[:, None] * stride_y + cols[None, :]
    mask = mine[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _rank_block(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def _hidden_split(num_row_tiles: int, hidden: int, device: torch.device) -> int:
    """How many programs share one tile's hidden size: a decode step has a few row tiles,
    and one program per tile and slot would leave most multiprocessors idle while it
    walks thousands of columns; a prefill has enough tiles."""
    wanted = triton.cdiv(2 * num_sms(device), num_row_tiles)
    return max(1, min(wanted, triton.cdiv(hidden, _SPLIT_MIN_COLUMNS)))


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    num_rows, hidden = x.shape
    num_slots, rank, _ = a.shape
    row_tiles = triton.cdiv(num_rows, _BLOCK_M)
    split = _hidden_split(row_tiles, hidden, x.device)
    block_h = 64
    chunk = triton.cdiv(triton.cdiv(hidden, split), block_h) * block_h
    split = triton.cdiv(hidden, chunk)
    alloc = torch.zeros if split > 1 else torch.empty
    out = alloc((num_rows, rank), dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    _shrink_kernel[(row_tiles, num_slots, split)](
        x, a, slots, out, num_rows, rank, hidden, chunk,
        x.stride(0), a.stride(0), a.stride(1), out.stride(0),
        BLOCK_M=_BLOCK_M, BLOCK_K=_rank_block(rank), BLOCK_H=block_h,
        PRECISION=_precision(x.dtype), SPLIT=split > 1, num_warps=4,
        launch_pdl=launch_pdl(x),
    )  # fmt: skip
    return out


def lora_expand(
    shrunk: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    num_rows, width = y.shape
    num_slots, _, rank = b.shape
    if num_rows == 0:
        return y
    if y.stride(-1) != 1:
        raise ValueError("lora_expand adds into y in place: its rows must be contiguous")
    block_n = 64
    grid = (triton.cdiv(num_rows, _BLOCK_M), triton.cdiv(width, block_n), num_slots)
    _expand_kernel[grid](
        shrunk, b, slots, y, num_rows, rank, width,
        shrunk.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=_BLOCK_M, BLOCK_N=block_n, BLOCK_K=_rank_block(rank),
        PRECISION=_precision(b.dtype), num_warps=4, launch_pdl=launch_pdl(y),
    )  # fmt: skip
    return y
