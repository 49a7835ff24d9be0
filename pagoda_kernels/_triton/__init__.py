"""Triton kernels; imported only through ``kernels._backend``, never by ``import kernels``.

Under ``TRITON_INTERPRET=1`` (CI runs the kernels on CPU that way) three small fixes are
applied to Triton 3.6's interpreter; compiled GPU kernels are never touched.
"""

import os


def _patch_interpreter_scalar_index() -> None:
    """Let ``range()`` take loaded scalars under ``TRITON_INTERPRET=1`` with NumPy >= 2.4.

    Triton 3.6's interpreter keeps scalars as 1-element arrays and converts them with
    ``int(array)``, which NumPy 2.4 rejects for 1-d arrays; our kernels loop over KV tiles
    with data-dependent bounds, so the interpreter needs ``.item()`` there. Compiled
    kernels are unaffected.
    """
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_pagoda_patched", False):
        return

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._pagoda_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


def _patch_interpreter_bf16_dot() -> None:
    """Make ``tl.dot`` on bfloat16 operands correct under the interpreter.

    Triton 3.6's interpreter stores bfloat16 as raw uint16 bits and multiplies those bits.
    Widening to float32 first is exact (a bf16 product fits in float32), so this gives
    what the GPU's bf16 MMA with float32 accumulation gives.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "_pagoda_patched", False):
        return

    def widen(handle):  # type: ignore[no-untyped-def]
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << np.uint32(16)
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot._pagoda_patched = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot


def _patch_interpreter_fp8_casts() -> None:
    """Round to float8_e4m3fn correctly under the interpreter.

    Triton 3.6's interpreter converts floats bit by bit and rounds a downcast by adding the
    first cut-off bit to the mantissa, without the carry into the exponent or ties to
    even: about one value in ten lands on the wrong fp8 neighbour. The GPU rounds to
    nearest even (``cvt.rn.satfinite``), as torch does, so casts to and from e4m3 go
    through torch here (values are clamped to +-448 by the kernels before a downcast).
    """
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_fp_to_fp
    if getattr(original, "_pagoda_patched", False):
        return

    def create_fp_to_fp(self, src, dst_type, rounding_mode):  # type: ignore[no-untyped-def]
        source, target = src.dtype.scalar, dst_type.scalar
        if target == tl.float8e4nv and source == tl.float32:
            values = torch.from_numpy(np.ascontiguousarray(src.data))
            data = values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return interpreter.TensorHandle(data, target)
        if source == tl.float8e4nv and target == tl.float32:
            bits = torch.from_numpy(np.ascontiguousarray(src.data))
            data = bits.view(torch.float8_e4m3fn).float().numpy()
            return interpreter.TensorHandle(data, target)
        return original(self, src, dst_type, rounding_mode)

    create_fp_to_fp._pagoda_patched = True  # type: ignore[attr-defined]
    builder.create_fp_to_fp = create_fp_to_fp


if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
    _patch_interpreter_scalar_index()
    _patch_interpreter_bf16_dot()
    _patch_interpreter_fp8_casts()
