"""4-bit projections (W4A16) of AWQ, GPTQ and compressed-tensors checkpoints: one linear
for all three.

Each projection is an ``Int4Weights`` module in the layout of ``kernels.int4_linear``
(codes packed along K, float32 scales and uint8 zero points per group, an optional
g_idx). Whatever the checkpoint stores is decoded by its format's module (``awq.py``,
``gptq.py``, ``compressed_tensors.py``: the bit orders, the zero-point conventions) into
codes [n, k], scales and zeros [n, G] and g_idx, and repacked here, one rank's shard of
one tensor at a time.

Tensor parallelism: column-parallel projections (qkv, gate_up) take their rows of codes,
scales and zeros (AWQ packs output features eight a word: a shard must start on a word);
row-parallel ones (o, down) take their columns of codes and the groups those columns
cover, which must be whole groups: a TP size that splits a group is refused when the
model is built. Under act order (``g_idx``) a rank's columns may belong to any group, so
it holds every group's scales and zeros (as vLLM does), and per-channel scales are
whole on every rank.

Act order, once loaded (``sort_act_order``): where a projection holds all of its input
columns (no row-parallel shard) and each group's columns are exactly ``group_size`` of
them, as GPTQ writes them, the columns are reordered by group at load time and the input
is gathered into that order each step (one small gather): the weight then reads like one
without act order and takes the fast kernels (``kernels.int4_linear``'s GEMVs up to 16
rows, the dequantization without a g_idx above). Otherwise the g_idx stays.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

import pagoda_kernels as kernels
from inference.quantization import awq, compressed_tensors, gptq
from inference.quantization.int4_config import Int4Checkpoint, split_group_error
from inference.quantization.int4_packing import pack_codes

FORMATS = {"awq": awq, "gptq": gptq, "compressed-tensors": compressed_tensors}


def _frozen(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Int4Weights(nn.Module):
    """One projection: [N, K] (this rank's shard; ``k_full`` the unsharded K)."""

    def __init__(self, n: int, k: int, k_full: int, scheme: Int4Checkpoint, name: str) -> None:
        super().__init__()
        self.shape = (n, k)
        group = k_full if scheme.group_size == -1 else scheme.group_size
        if scheme.act_order:
            num_groups = -(-k_full // group)
        elif scheme.group_size == -1:
            num_groups, group = 1, k
        elif k != k_full and k % group:
            raise ValueError(split_group_error(name, k_full, k_full // k, group))
        else:
            num_groups = -(-k // group)
        self.group_size = group
        self.k_full = k_full
        self.qweight = _frozen(n, -(-k // 8), dtype=torch.int32)
        self.scales = _frozen(n, num_groups, dtype=torch.float32)
        self.zeros = _frozen(n, num_groups, dtype=torch.uint8)
        self.g_idx = _frozen(k, dtype=torch.int32) if scheme.act_order else None
        self._g_idx_loaded = False
        # Act order sorted at load (``sort_act_order``): input column j of the packed
        # weight is the checkpoint's column input_order[j].
        self.input_order: torch.Tensor | None = None
        # One buffer shared by every projection of the model (``share_dequant_scratch``).
        self.scratch: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        return kernels.int4_linear(x, self.qweight, self.scales, self.zeros, self.group_size,
                                   self.g_idx, bias, out, self.scratch)  # fmt: skip

    def dequantized(self) -> torch.Tensor:
        """The float32 [N, K] weight held, in the checkpoint's column order (for checks)."""
        from pagoda_kernels.int4_linear import dequantize_int4

        weight = dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size,
                                 self.g_idx, self.shape[1])  # fmt: skip
        if self.input_order is None:
            return weight
        original = torch.empty_like(weight)
        original[:, self.input_order] = weight
        return original

    def sort_act_order(self) -> bool:
        """Reorder an act-order weight's input columns by group (see the module docstring);
        False where it cannot be (a row-parallel shard, groups not of ``group_size``)."""
        if self.g_idx is None or self.shape[1] != self.k_full:
            return False
        from pagoda_kernels.int4_linear import unpack_codes

        k = self.shape[1]
        g_idx = self.g_idx.data.long()
        order = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[order], torch.arange(k, device=g_idx.device) // self.group_size):
            return False
        if not torch.equal(order, torch.arange(k, device=order.device)):
            codes = unpack_codes(self.qweight.data, k)
            self.qweight.data.copy_(pack_codes(codes[:, order]))
            self.input_order = order
        self.g_idx = None
        return True


def sort_act_order(model: nn.Module) -> int:
    """Every act-order projection that can be, sorted by group (``Int4Weights.sort_act_order``);
    returns how many were."""
    return sum(m.sort_act_order() for m in model.modules() if isinstance(m, Int4Weights))


def share_dequant_scratch(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """On a GPU, one buffer the size of the largest projection, shared by all of them:
    steps above the GEMV's rows dequantize a projection into it for cuBLAS (projections
    run one after another on one stream, so one buffer serves all). Allocated at load, so
    the KV-cache sizing sees it."""
    projections = [m for m in model.modules() if isinstance(m, Int4Weights)]
    if not projections or torch.device(device).type != "cuda":
        return
    scratch = torch.empty(max(m.shape[0] * m.shape[1] for m in projections), dtype=dtype,
                          device=device)  # fmt: skip
    for module in projections:
        module.scratch = scratch


@dataclass
class Int4Part:
    """A shard of one checkpoint projection, decoded."""

    codes: torch.Tensor  # [n, k], 0..15
    scales: torch.Tensor  # float32 [n, G]
    zeros: torch.Tensor  # [n, G]
    g_idx: torch.Tensor | None  # int32 [k]


@dataclass
class Int4CheckpointWeight:
    """A checkpoint's packed projection (a tensor or a lazy safetensors entry) with the
    small tensors stored beside it (scales, zero points, g_idx, shape)."""

    packed: object
    aux: dict[str, torch.Tensor]
    scheme: Int4Checkpoint

    def read(self, source: tuple[int | None, int, int]) -> Int4Part:
        """The part ``source`` = (dim of [N, K], start, length; dim None: all)."""
        fmt, scheme = FORMATS[self.scheme.method], self.scheme
        n, k = fmt.logical_shape(tuple(self.packed.shape), self.aux)
        scales, zeros, g_idx = fmt.metadata(self.aux, scheme, n, k)
        g_idx = _checked_g_idx(g_idx, scheme, k)
        dim, start, length = source
        rows = (start, length) if dim == 0 else (0, n)
        cols = (start, length) if dim == 1 else (0, k)
        codes = fmt.read_codes(self.packed, source)[:, : cols[1]]
        scales, zeros = scales.narrow(0, *rows), zeros.narrow(0, *rows)
        if dim == 1 and g_idx is None and scheme.group_size != -1:
            size = scheme.group_size
            first, count = start // size, -(-length // size)
            scales, zeros = scales.narrow(1, first, count), zeros.narrow(1, first, count)
        if g_idx is not None:
            g_idx = g_idx.narrow(0, *cols)
        return Int4Part(codes, scales.contiguous(), zeros.contiguous(), g_idx)


def _checked_g_idx(g_idx: torch.Tensor | None, scheme: Int4Checkpoint,
                   k: int) -> torch.Tensor | None:  # fmt: skip
    """The g_idx the engine uses: the stored one under act order, else None (a stored
    g_idx must then be the plain k // group_size)."""
    if scheme.act_order:
        if g_idx is None:
            raise ValueError(f"a {scheme.method} act-order checkpoint without g_idx tensors")
        return g_idx
    if g_idx is not None:
        size = k if scheme.group_size == -1 else scheme.group_size
        if not torch.equal(g_idx.long(), torch.arange(k, device=g_idx.device) // size):
            raise ValueError(f"{scheme.method} g_idx out of group order, but the config "
                             "declares no act order (desc_act / actorder)")  # fmt: skip
    return None


def load_projection(module: Int4Weights, rows: tuple[int, int] | None, weight,
                    source: tuple[int | None, int, int], name: str) -> None:  # fmt: skip
    """Fill rows ``rows`` (None: all) of ``module`` from one checkpoint projection's
    shard ``source``."""
    if not isinstance(weight, Int4CheckpointWeight):
        raise ValueError(f"weight {name}: full precision in a 4-bit checkpoint, whose "
                         "projections this engine runs in 4 bits only")  # fmt: skip
    part = weight.read(source)
    start, count = rows if rows is not None else (0, module.shape[0])
    if part.codes.shape != (count, module.shape[1]) or part.scales.shape != (
        count, module.scales.shape[1]
    ):  # fmt: skip
        raise ValueError(
            f"weight {name}: {tuple(part.codes.shape)} with {part.scales.shape[1]} groups, "
            f"expected {(count, module.shape[1])} with {module.scales.shape[1]}"
        )
    device = module.qweight.device
    module.qweight.data.narrow(0, start, count).copy_(pack_codes(part.codes.to(device)))
    module.scales.data.narrow(0, start, count).copy_(part.scales)
    module.zeros.data.narrow(0, start, count).copy_(part.zeros.to(torch.uint8))
    if module.g_idx is not None:
        if not module._g_idx_loaded:
            module.g_idx.data.copy_(part.g_idx)
            module._g_idx_loaded = True
        elif not torch.equal(module.g_idx.data, part.g_idx.to(device)):
            raise ValueError(f"weight {name}: its g_idx differs from that of the projections "
                             "it is fused with (q/k/v, gate/up), which share one input")  # fmt: skip


def is_aux_name(name: str, scheme: Int4Checkpoint) -> bool:
    """A small tensor stored beside a packed projection (read up front by the loader:
    it may sit in another file than its weight)."""
    return name.rsplit(".", 1)[-1] in FORMATS[scheme.method].AUX_NAMES


def with_int4_tensors(entries: Iterable[tuple[str, object]], aux: dict[str, torch.Tensor],
                      scheme: Int4Checkpoint) -> Iterator[tuple[str, object]]:  # fmt: skip
    """The checkpoint's tensors as the model loads them: each packed projection becomes
    ``<prefix>.weight``, an ``Int4CheckpointWeight`` with its ``aux`` tensors; the aux
    tensors themselves are consumed here."""
    fmt = FORMATS[scheme.method]
    for name, weight in entries:
        suffix = name.rsplit(".", 1)[-1]
        if suffix in fmt.AUX_NAMES or _is_zero_extra_bias(name, weight):
            continue
        if suffix == fmt.PACKED_NAME:
            prefix = name[: -len(suffix)]
            mine = {s: aux[prefix + s] for s in fmt.AUX_NAMES if prefix + s in aux}
            yield prefix + "weight", Int4CheckpointWeight(weight, mine, scheme)
            continue
        yield name, weight


# Projections no supported architecture gives a bias.
_UNBIASED = ("o_proj", "gate_proj", "up_proj", "down_proj")


def _is_zero_extra_bias(name: str, weight) -> bool:
    """An all-zero bias of a projection that has none: AutoGPTQ writes one for every
    quantized linear of some models (vLLM skips them too)."""
    parts = name.split(".")
    if len(parts) < 2 or parts[-1] != "bias" or parts[-2] not in _UNBIASED:
        return False
    tensor = weight if isinstance(weight, torch.Tensor) else weight.read()
    if tensor.any():
        raise ValueError(f"checkpoint tensor {name}: a bias this architecture does not have")
    return True


@torch.no_grad()
def fill_dummy(module: Int4Weights, std: float) -> None:
    """Random weights of a benchmark (``load_format=dummy``): uniform codes around zero
    point 8 with scales giving a weight std of about ``std``."""
    module.qweight.data.random_(-(2**31), 2**31 - 1)
    module.scales.data.fill_(std / 4.6)  # the std of (uniform 0..15) - 8
    module.zeros.data.fill_(8)
    if module.g_idx is not None:
        k = module.shape[1]
        module.g_idx.data.copy_(torch.arange(k) // module.group_size % module.scales.shape[1])
