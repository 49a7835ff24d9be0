"""Who this process is in a tensor-parallel group, and the two collectives the model needs.

A ``ParallelContext`` is passed explicitly (runner -> model -> layers); there is no module
global. With ``world_size == 1`` every collective returns its input untouched and nothing
from ``torch.distributed`` is imported or called, so the single-GPU path pays nothing.
"""

from __future__ import annotations

import socket
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch


@dataclass(frozen=True)
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # the torch.distributed process group; None when world_size == 1
    # One-shot all-reduce over symmetric (peer-mapped) memory for small tensors on GPUs:
    # decode steps all-reduce a few KB twice a layer, where NCCL's latency dominates.
    small_all_reduce: SymmetricMemoryAllReduce | None = None

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks: ``tensor`` itself, summed in place, or a new tensor when
        ``tensor`` lives in the staging buffer handed out by ``all_reduce_input``."""
        if self.world_size == 1:
            return tensor
        if self.small_all_reduce is not None:
            result = self.small_all_reduce(tensor)
            if result is not None:
                return result
        import torch.distributed as dist

        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_reduce_input(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Where to write a [rows, cols] result that is all-reduced next: the small
        all-reduce's staging buffer when it will take the tensor (the producer writes there
        and the copy into it is saved), else None (allocate as usual)."""
        if self.small_all_reduce is None:
            return None
        return self.small_all_reduce.input_buffer(rows, cols, dtype)

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along the last dimension, rank order."""
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        tensor = tensor.contiguous()
        # Ranks stacked along dim 0 in one buffer (all_gather_into_tensor): gloo takes that
        # layout, and one flat collective keeps the NCCL path CUDA-graph capturable.
        gathered = torch.empty(
            (self.world_size * tensor.shape[0], *tensor.shape[1:]),
            dtype=tensor.dtype, device=tensor.device,
        )
        # torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated).
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, tensor, group=self.group)
        gathered = gathered.view(self.world_size, *tensor.shape)
        return gathered.movedim(0, -2).reshape(*tensor.shape[:-1], -1)

    def all_reduce_min(self, value: int) -> int:
        """The smallest of every rank's ``value`` (host int), e.g. KV blocks that fit."""
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())


SINGLE = ParallelContext()


class SymmetricMemoryAllReduce:
    """Sum of a small tensor over the group in one kernel: each rank copies its tensor into
    a buffer every peer can read over NVLink, and every rank adds up all the buffers.
    Replaces NCCL up to ``max_bytes`` (larger, prefill-sized tensors stay with NCCL).
    CUDA-graph capturable; multicast (NVLS) is not used."""

    def __init__(self, group: Any, device: torch.device, dtype: torch.dtype,
                 max_bytes: int = 1 << 20) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed by older torch; newer ones only warn that it is not
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(self.group_name)
        self.dtype = dtype
        self.buffer = symm_mem.empty(
            max_bytes // torch.tensor([], dtype=dtype).element_size(), dtype=dtype, device=device
        )
        symm_mem.rendezvous(self.buffer, self.group_name)
        self._out_op = getattr(torch.ops.symm_mem, "one_shot_all_reduce_out", None)

    def input_buffer(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor | None:
        if dtype != self.dtype or rows * cols > self.buffer.numel():
            return None
        return self.buffer[: rows * cols].view(rows, cols)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The sum of ``tensor`` over the group, or None (not handled: too big, another
        dtype, not contiguous). In place, unless ``tensor`` is the staging buffer itself
        (see ``input_buffer``): then the sum is a new tensor."""
        n = tensor.numel()
        if n > self.buffer.numel() or tensor.dtype != self.dtype or not tensor.is_contiguous():
            return None
        staged = self.buffer[:n]
        if tensor.data_ptr() == staged.data_ptr():
            result = torch.empty_like(tensor)
        else:
            staged.copy_(tensor.view(-1))
            result = tensor
        if self._out_op is not None:
            self._out_op(staged, "sum", self.group_name, result.view(-1))
        else:
            result.view(-1).copy_(torch.ops.symm_mem.one_shot_all_reduce(staged, "sum",
                                                                         self.group_name))
        return result


def with_small_all_reduce(context: ParallelContext, device: torch.device,
                          dtype: torch.dtype) -> ParallelContext:
    """``context`` with the symmetric-memory all-reduce when the GPUs support it (else as
    is: NCCL for everything). ``PAGODA_DISABLE_SYMM_MEM=1`` turns it off."""
    import dataclasses
    import logging
    import os

    if (
        context.world_size == 1 or device.type != "cuda"
        or os.environ.get("PAGODA_DISABLE_SYMM_MEM") == "1"
        or dtype not in (torch.bfloat16, torch.float16, torch.float32)
    ):
        return context
    try:
        fast = SymmetricMemoryAllReduce(context.group, device, dtype)
        # Check it once against NCCL before trusting it.
        import torch.distributed as dist

        probe = torch.full((4096,), float(context.rank + 1), dtype=dtype, device=device)
        expected = probe.clone()
        dist.all_reduce(expected, group=context.group)
        if fast(probe) is None or not torch.equal(probe, expected):
            raise RuntimeError("symmetric-memory all-reduce disagrees with NCCL")
        # Written straight into the staging buffer, as the layers do: the same sum.
        staged = fast.input_buffer(1, 4096, dtype)
        staged.fill_(float(context.rank + 1))
        if not torch.equal(fast(staged).view(-1), expected):
            raise RuntimeError("symmetric-memory all-reduce disagrees with NCCL")
    except Exception as exc:  # noqa: BLE001 - any failure means: keep NCCL
        logging.getLogger(__name__).warning(
            "symmetric-memory all-reduce unavailable (%s); using NCCL for every all-reduce", exc
        )
        return context
    return dataclasses.replace(context, small_all_reduce=fast)


def init_parallel(
    rank: int, world_size: int, port: int, device_type: str, timeout_s: float = 1800.0
) -> ParallelContext:
    """Join the group over TCP on 127.0.0.1:``port`` (workers of one host): NCCL between
    GPUs, gloo on CPU."""
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )
    return ParallelContext(rank, world_size, dist.group.WORLD)


def destroy_parallel(context: ParallelContext) -> None:
    if context.world_size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def free_local_port() -> int:
    """A port free right now on 127.0.0.1, for the group's TCP rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- how a model's shapes split over ranks -------------------------------------------------


def check_divisible(
    num_heads: int, num_kv_heads: int, intermediate_size: int, world_size: int
) -> None:
    """ValueError unless the model can be split ``world_size`` ways."""
    if world_size == 1:
        return
    if num_heads % world_size:
        raise ValueError(
            f"tensor_parallel_size={world_size} must divide the model's "
            f"num_attention_heads ({num_heads})"
        )
    if num_kv_heads % world_size and world_size % num_kv_heads:
        raise ValueError(
            f"the model's num_key_value_heads ({num_kv_heads}) and tensor_parallel_size="
            f"{world_size} must divide one another (heads are split, or replicated when "
            "there are fewer KV heads than ranks)"
        )
    if intermediate_size % world_size:
        raise ValueError(
            f"tensor_parallel_size={world_size} must divide the model's "
            f"intermediate_size ({intermediate_size})"
        )


def kv_head_range(num_kv_heads: int, rank: int, world_size: int) -> tuple[int, int]:
    """(first KV head, count) a rank holds: an equal share, or the one head its query heads
    use when there are fewer KV heads than ranks (that head is then replicated)."""
    if num_kv_heads >= world_size:
        per_rank = num_kv_heads // world_size
        return rank * per_rank, per_rank
    return rank * num_kv_heads // world_size, 1


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """(first id, rows held, rows with real ids): the vocabulary is padded up to a multiple
    of ``world_size`` so every rank's shard, and so the all-gather, has one shape."""
    per_rank = -(-vocab_size // world_size)
    start = rank * per_rank
    return start, per_rank, max(0, min(per_rank, vocab_size - start))
