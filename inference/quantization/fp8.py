"""FP8 weights: per-output-channel float8_e4m3fn projections, filled from any source.

A quantized projection is two parameters: ``<name>`` float8_e4m3fn [N, K] (this rank's
shard) and ``<name>_scale`` float32 [N], with ``weight = <name> * <name>_scale[:, None]``.
Whatever the checkpoint holds is turned into that one layout while loading, one tensor
(one rank's shard of it) at a time:

- a bf16/fp16/fp32 tensor (online quantization): ``scale = amax(|row|) / 448``, the row
  divided by it and rounded to e4m3;
- an e4m3 tensor with per-channel scales (compressed-tensors ``strategy: channel``): taken
  as is; per-tensor scales (``strategy: tensor``, or HF fp8 without blocks) become the
  same scale on every row, exactly;
- an e4m3 tensor with block-wise scales (``weight_block_size`` [128, 128]): dequantized to
  float32 and requantized per channel. This costs a second e4m3 rounding of each weight
  whose block scale differs from its row's: on random weights ([32, 48] blocks,
  ``tests/engine/test_fp8_weights.py``) 2.5 % relative rms error on top of the
  checkpoint's own 2.65 %, ~1.4x the checkpoint's weight error in all. A block-scaled
  GEMM would avoid it, at the price of a second kernel family.

Tensor parallelism: a rank reads its shard of the weight, then the matching scales
(column-parallel shards rows and so rows of the scale; row-parallel shards K, so a
checkpoint's per-channel scale is read whole, and an online or requantized scale is that
of the rank's own columns: each rank's rows are quantized on their own).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from inference.layers.kv_cache import kv_scale_kind
from inference.quantization import Fp8Checkpoint
from pagoda_kernels.fp8_linear import FP8_DTYPE, FP8_MAX

# Tensor-name suffixes a quantized checkpoint stores beside a projection's ``weight``.
_WEIGHT_SCALES = ("weight_scale_inv", "weight_scale")
# Scales of schemes this engine does not run (static activations, an FP8 KV cache).
# Static activation scales. KV-cache scales under vLLM's names (``self_attn.k_scale``,
# ``k_proj.output_scale``, ...) pass through to the model, which loads them for an FP8 KV
# cache (``inference.layers.kv_cache``).
_REFUSED_SCALES = ("input_scale", "k_scale", "v_scale", "kv_scale", "output_scale")
# Smallest weight scale (an all-zero row quantizes to zeros, not NaN).
_MIN_SCALE = 1e-12


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype) -> (float8_e4m3fn [N, K], float32 scale [N])."""
    rows = weight.float()
    scale = (rows.abs().amax(dim=1) / FP8_MAX).clamp_min(_MIN_SCALE)
    quantized = (rows / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale


@dataclass
class Fp8CheckpointWeight:
    """A checkpoint's e4m3 projection weight (a tensor or a lazy safetensors entry) with
    the scale tensor stored beside it."""

    data: object
    scale: torch.Tensor
    block_size: tuple[int, int] | None

    def read(self, source: tuple[int | None, int, int], full_shape: tuple[int, int]
             ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(e4m3 shard, float32 per-row scale of the shard) of the part ``source`` =
        (dim, start, length) of the [N, K] weight (dim None: all of it)."""
        quantized = read_part(self.data, source)
        if quantized.dtype != FP8_DTYPE:
            raise ValueError(
                f"an FP8 checkpoint's projection weight is {quantized.dtype}, expected "
                "float8_e4m3fn"
            )
        dim, start, length = source
        rows = (start, length) if dim == 0 else (0, full_shape[0])
        cols = (start, length) if dim == 1 else (0, full_shape[1])
        scale = self.scale.to(device=quantized.device, dtype=torch.float32)
        if self.block_size is not None and scale.numel() > 1:
            block_rows, block_cols = self.block_size
            row_blocks = torch.arange(rows[0], rows[0] + rows[1], device=scale.device)
            col_blocks = torch.arange(cols[0], cols[0] + cols[1], device=scale.device)
            elementwise = scale[row_blocks // block_rows][:, col_blocks // block_cols]
            return quantize_per_channel(quantized.float() * elementwise)
        if scale.numel() == 1:
            return quantized, scale.reshape(1).expand(rows[1]).contiguous()
        if scale.numel() != full_shape[0]:
            raise ValueError(
                f"weight scale of {scale.numel()} values for a [{full_shape[0]}, "
                f"{full_shape[1]}] weight: expected one per output channel or one in all"
            )
        return quantized, scale.reshape(-1).narrow(0, *rows).contiguous()


def load_projection(
    weight_param: torch.Tensor,
    scale_param: torch.Tensor,
    rows: tuple[int, int] | None,
    weight,
    source: tuple[int | None, int, int],
    name: str,
) -> None:
    """Fill rows ``rows`` (None: all) of a quantized projection and its scale from one
    checkpoint tensor's shard ``source``."""
    dest = weight_param.data if rows is None else weight_param.data.narrow(0, *rows)
    dest_scale = scale_param.data if rows is None else scale_param.data.narrow(0, *rows)
    if isinstance(weight, Fp8CheckpointWeight):
        quantized, scale = weight.read(source, tuple(weight.data.shape))
    else:
        quantized, scale = quantize_per_channel(read_part(weight, source))
    if dest.shape != quantized.shape:
        raise ValueError(
            f"weight {name}: shape {tuple(quantized.shape)}, expected {tuple(dest.shape)}"
        )
    dest.copy_(quantized)
    dest_scale.copy_(scale)


def read_part(weight, source: tuple[int | None, int, int]) -> torch.Tensor:
    """The part (dim, start, length) of a tensor or of a lazy safetensors entry (which
    then reads only that part; see ``models.loader.SafetensorsWeight``)."""
    dim, start, length = source
    if isinstance(weight, torch.Tensor):
        return weight if dim is None else weight.narrow(dim, start, length)
    return weight.read(dim, start, length)


def with_checkpoint_scales(
    entries: Iterable[tuple[str, object]],
    scales: dict[str, torch.Tensor],
    scheme: Fp8Checkpoint,
) -> Iterator[tuple[str, object]]:
    """The checkpoint's tensors as the model loads them: each projection weight that has
    a scale becomes an ``Fp8CheckpointWeight``; the scale tensors themselves are consumed
    here. ``scales``: every ``*.weight_scale(_inv)`` tensor, read beforehand (they may
    sit in another file than their weight)."""
    for name, weight in entries:
        suffix = name.rsplit(".", 1)[-1]
        if suffix in _WEIGHT_SCALES:
            continue
        if suffix in _REFUSED_SCALES and not _is_kv_cache_scale(name):
            raise ValueError(
                f"checkpoint tensor {name}: static activation or KV-cache scales are not "
                "supported (only FP8 weights with dynamic activation scales)"
            )
        if suffix == "weight":
            prefix = name[: -len("weight")]
            scale = next((scales[prefix + s] for s in _WEIGHT_SCALES if prefix + s in scales),
                         None)  # fmt: skip
            if scale is not None:
                weight = Fp8CheckpointWeight(weight, scale, scheme.block_size)
        yield name, weight


def _is_kv_cache_scale(name: str) -> bool:
    parts = name.removeprefix("model.").split(".")
    return (len(parts) >= 4 and parts[0] == "layers" and parts[2] == "self_attn"
            and kv_scale_kind(".".join(parts[3:])) is not None)  # fmt: skip


def is_scale_name(name: str) -> bool:
    """A projection's weight scale (read up front by the loader)."""
    return name.rsplit(".", 1)[-1] in _WEIGHT_SCALES


@torch.no_grad()
def fill_dummy(weight_param: torch.Tensor, scale_param: torch.Tensor, std: float) -> None:
    """Random weights of a benchmark (``load_format=dummy``): N(0, std) quantized per
    channel, a few rows at a time (no full-precision copy of a large matrix)."""
    rows_per_chunk = max(1, (64 << 20) // (4 * weight_param.shape[1]))
    for start in range(0, weight_param.shape[0], rows_per_chunk):
        rows = weight_param.data[start : start + rows_per_chunk]
        values = torch.empty(rows.shape, dtype=torch.float32, device=rows.device).normal_(0, std)
        quantized, scale = quantize_per_channel(values)
        rows.copy_(quantized)
        scale_param.data[start : start + rows.shape[0]].copy_(scale)
