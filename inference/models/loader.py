"""Build a model and fill it from a Hugging Face folder's safetensors files."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from inference.models import get_model_class
from inference.models.config import ModelConfig
from inference.models.llama import LlamaForCausalLM
from inference.parallel_state import SINGLE, ParallelContext
from inference.quantization import (
    Int4Checkpoint,
    checkpoint_scheme,
    fp8,
    int4,
)


class SafetensorsWeight:
    """One tensor of an open safetensors file, read on demand: whole, or only a slice
    along one dimension (a tensor-parallel rank's shard) without materialising the rest."""

    __slots__ = ("file", "name")

    def __init__(self, file, name: str) -> None:
        self.file, self.name = file, name

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.file.get_slice(self.name).get_shape())

    def read(self, dim: int | None = None, start: int = 0, length: int = 0) -> torch.Tensor:
        if dim is None:
            return self.file.get_tensor(self.name)
        index = [slice(None)] * (dim + 1)
        index[dim] = slice(start, start + length)
        return self.file.get_slice(self.name)[tuple(index)]


def iter_safetensors(folder: Path, device: torch.device) -> Iterator[tuple[str, SafetensorsWeight]]:
    """(name, lazy weight) for every tensor of the folder; each is valid until the next."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no *.safetensors weights")
    for name in files:
        with safe_open(str(folder / name), framework="pt", device=str(device)) as f:
            for key in f.keys():
                yield key, SafetensorsWeight(f, key)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    folder: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
    load_format: str = "auto",
    parallel: ParallelContext = SINGLE,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """The model of ``folder`` on ``device``; ``quantization="fp8"``: its projections in
    FP8 (quantized here from a full-precision checkpoint, or as an FP8 checkpoint stores
    them: ``inference.quantization``). ``quantization`` is the scheme resolved for the
    checkpoint (``EngineConfig.resolve``): an FP8 checkpoint's is always "fp8"."""
    folder = Path(folder)
    cls = get_model_class(config)
    # Parameters are created uninitialised, straight on the target device and dtype.
    with _default_dtype(dtype), torch.device(device):
        model = cls(config, max_position=max_position, parallel=parallel,
                    quantization=quantization)  # fmt: skip
    model.cos_sin_cache = model.cos_sin_cache.to(device=device, dtype=torch.float32)
    with torch.no_grad():
        if load_format == "dummy":
            _fill_dummy(model)
        else:
            model.load_weights(_checkpoint_weights(folder, device, config))
        int4.sort_act_order(model)
    int4.share_dequant_scratch(model, dtype, device)
    return model.eval()


def _fill_dummy(model: LlamaForCausalLM) -> None:
    """Benchmarks of real model shapes: speed does not depend on the values."""
    int4_params = set()
    for module in model.modules():
        if isinstance(module, int4.Int4Weights):
            int4.fill_dummy(module, std=0.02)
            int4_params.update(id(p) for p in module.parameters())
    for name, param in model.named_parameters():
        if id(param) in int4_params:
            continue
        if param.dtype == fp8.FP8_DTYPE:
            fp8.fill_dummy(param, model.get_parameter(name + "_scale"), std=0.02)
        elif not name.endswith("_scale"):
            param.normal_(0.0, 0.02)


def _checkpoint_weights(folder: Path, device: torch.device, config: ModelConfig):
    """(name, weight) of the checkpoint; an FP8 checkpoint's projection weights come with
    their scales (``fp8.Fp8CheckpointWeight``)."""
    scheme = checkpoint_scheme(config.quantization_config)
    if scheme is None:
        return iter_safetensors(folder, device)
    if isinstance(scheme, Int4Checkpoint):
        aux = {name: weight.read() for name, weight in iter_safetensors(folder, device)
               if int4.is_aux_name(name, scheme)}  # fmt: skip
        return int4.with_int4_tensors(iter_safetensors(folder, device), aux, scheme)
    scales = {name: weight.read() for name, weight in iter_safetensors(folder, device)
              if fp8.is_scale_name(name)}  # fmt: skip
    return fp8.with_checkpoint_scales(iter_safetensors(folder, device), scales, scheme)
