"""Programmatic dependent launch (PDL, Hopper and later) for the decode-path kernels.

A decode step is a chain of short kernels (at batch 1 most run for a few microseconds),
and between two of them the GPU drains the first grid, then launches and fills the next.
With PDL each kernel is launched with ``launch_pdl`` and starts with ``wait_for_inputs()``:

- ``griddepcontrol.wait`` blocks until the previous grid has completed and its writes are
  visible, so nothing a kernel reads or writes is touched before its producer is done;
- ``griddepcontrol.launch_dependents`` then lets the next kernel's programs be scheduled
  while this one runs, so its launch and prologue overlap this kernel instead of
  following it.

Both instructions are no-ops for a grid launched without PDL, and are compiled only for
sm_90 and later (``cuda_capability_geq``): the same kernel source runs everywhere,
including Triton's CPU interpreter. A chain through a kernel that is not ours (cuBLAS,
torch, NCCL) simply serializes as usual there. CUDA-graph capture records the
programmatic edges. ``PAGODA_DISABLE_PDL=1`` launches without it (for comparison).
"""

import functools
import os

import torch
import triton
import triton.language as tl  # noqa: F401 (the interpreter needs it visible)
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.language.target_info import cuda_capability_geq


@triton.jit
def wait_for_inputs():
    """First statement of every kernel launched with ``launch_pdl(...)``."""
    if cuda_capability_geq(9, 0):
        gdc_wait()
        gdc_launch_dependents()


@functools.cache
def _enabled_on(index: int) -> bool:
    disabled = os.environ.get("PAGODA_DISABLE_PDL", "") not in ("", "0")
    return not disabled and torch.cuda.get_device_capability(index)[0] >= 9


def launch_pdl(tensor: torch.Tensor) -> bool:
    """Whether a kernel working on ``tensor`` is launched with PDL (a CUDA tensor on
    sm_90+, unless ``PAGODA_DISABLE_PDL`` was set when the process first asked)."""
    if not tensor.is_cuda:
        return False
    index = tensor.device.index
    return _enabled_on(torch.cuda.current_device() if index is None else index)
