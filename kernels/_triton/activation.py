"""Triton SiLU-and-mul: ``silu(gate) * up`` for the gated MLP, computed in float32."""

import torch
import triton
import triton.language as tl

from kernels._triton.pdl import launch_pdl, wait_for_inputs


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, width, BLOCK: tl.constexpr):
    wait_for_inputs()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    result = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, result.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    width = x.shape[-1] // 2
    x_rows = x.reshape(-1, x.shape[-1])
    if x_rows.stride(-1) != 1:
        x_rows = x_rows.contiguous()
    out = torch.empty((x_rows.shape[0], width), dtype=x.dtype, device=x.device)
    if out.numel():
        block = min(1024, triton.next_power_of_2(width))
        _silu_and_mul_kernel[(x_rows.shape[0], triton.cdiv(width, block))](
            x_rows, out, x_rows.stride(0), out.stride(0), width,
            BLOCK=block, num_warps=4 if block >= 512 else 1,
            launch_pdl=launch_pdl(x_rows),
        )  # fmt: skip
    return out.view(*x.shape[:-1], width)
