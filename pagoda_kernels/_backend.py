"""Which implementation an op runs: the Triton kernel or the plain-torch reference.

The rule, shared by every op:

- ``PAGODA_DISABLE_TRITON=1`` forces the reference everywhere;
- a CUDA tensor runs the Triton kernel;
- a CPU tensor runs the Triton kernel only under ``TRITON_INTERPRET=1`` (Triton's own
  interpreter, which is how CI tests the kernels without a GPU);
- anything else, or a machine without Triton, runs the reference.

Triton is imported lazily: ``import kernels`` never needs it, and on a CPU-only machine
without ``TRITON_INTERPRET`` the kernel modules are never loaded. Note that Triton reads
``TRITON_INTERPRET`` when a kernel module is first imported, so the variable must be set
before the first Triton dispatch in a process.
"""

import functools
import importlib
import importlib.util
import os
import warnings
from types import ModuleType

import torch


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def use_triton(tensor: torch.Tensor) -> bool:
    """True when ``tensor``'s op should run its Triton kernel (see the module docstring)."""
    if _flag("PAGODA_DISABLE_TRITON") or not triton_available():
        return False
    if tensor.is_cuda:
        return True
    return tensor.device.type == "cpu" and _flag("TRITON_INTERPRET")


@functools.cache
def triton_module(name: str) -> ModuleType | None:
    """Import ``kernels._triton.<name>``; None (and one warning) if Triton fails to load,
    so the caller falls back to the reference instead of crashing the engine."""
    try:
        return importlib.import_module(f"pagoda_kernels._triton.{name}")
    except ImportError as error:  # a broken or partial Triton install
        warnings.warn(f"Triton kernels unavailable, using references: {error}", stacklevel=2)
        return None


def kernel_for(name: str, tensor: torch.Tensor) -> ModuleType | None:
    """The Triton module for op file ``name`` if ``tensor`` should use it, else None."""
    if not use_triton(tensor):
        return None
    return triton_module(name)


@functools.cache
def num_sms(device: torch.device) -> int:
    """Multiprocessor count, used to size split-K grids; a small stand-in off the GPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
