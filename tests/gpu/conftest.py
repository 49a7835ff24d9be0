"""Sharding of the GPU suite over the GPUs of one machine (``tests/gpu/run_suite.sh``).

``PAGODA_GPU_SHARD=i/n`` keeps every n-th collected test starting at the i-th, so n pytest
processes, each with its own ``CUDA_VISIBLE_DEVICES``, split the suite between them; the
engine start-ups (weights, KV sizing, CUDA-graph capture) are most of its time, so n GPUs
take about 1/n of it. Unset, every test runs.
"""

from __future__ import annotations

import os

import pytest


def _shard() -> tuple[int, int] | None:
    value = os.environ.get("PAGODA_GPU_SHARD")
    if not value:
        return None
    index, _, count = value.partition("/")
    shard = (int(index), int(count))
    if not 0 <= shard[0] < shard[1]:
        raise pytest.UsageError(f"PAGODA_GPU_SHARD={value!r}: want i/n with 0 <= i < n")
    return shard


@pytest.hookimpl(trylast=True)  # after -k/-m deselection, so shards stay even
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    shard = _shard()
    if shard is None:
        return
    index, count = shard
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    deselected = [item for i, item in enumerate(gpu_items) if i % count != index]
    if deselected:
        drop = set(map(id, deselected))
        items[:] = [item for item in items if id(item) not in drop]
        config.hook.pytest_deselected(items=deselected)


@pytest.fixture(autouse=True, scope="module")
def _ieee_fp32():
    # References must be true float32: no TF32 in transformers' matmuls.
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    # Each engine sizes its KV cache from the free memory: the previous one must be gone.
    yield
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- models the GPU test files share (built once per session) -------------------------

@pytest.fixture(scope="session")
def qwen_1p5b_shape(tmp_path_factory):
    """Random Qwen2 in Qwen2.5-1.5B's per-layer shapes, 6 layers, float32; q/k weights
    with std 0.05 (the rest 0.02) so that attention is sharp."""
    from differential import Reference
    from gpu_matrix import sharp_qwen2

    folder = tmp_path_factory.mktemp("qwen-1.5b-shape")
    model = sharp_qwen2(folder, vocab_size=151936, intermediate_size=8960, num_hidden_layers=6,
                        max_position_embeddings=4608, bos_token_id=151643,
                        eos_token_id=151645)  # fmt: skip
    return str(folder), Reference(model.to("cuda"), "cuda")


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """The matrix's tiny models (gpu_matrix.MODELS): {arch: (folder, transformers model)}."""
    from gpu_matrix import MAX_MODEL_LEN, MODELS
    from tiny_models import build_tiny_model

    built = {}
    for arch, shape in MODELS.items():
        folder = tmp_path_factory.mktemp(f"diff-{arch}")
        model = build_tiny_model(folder, arch, seed=5, initializer_range=0.02,
                                 max_position_embeddings=MAX_MODEL_LEN, **shape)
        built[arch] = (str(folder), model)
    return built
