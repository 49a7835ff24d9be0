"""Fixtures shared by the server tests: model folders and a shared tiny-model server."""

from __future__ import annotations

import pytest
from server_harness import TINY_MAX_MODEL_LEN, TINY_NUM_KV_BLOCKS, ServerThread
from tiny_models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny_llama")
    build_tiny_model(folder, "llama")
    return str(folder)


@pytest.fixture(scope="session")
def smol_model() -> str:
    """The embedded SmolLM2-135M-Instruct: small, but answers coherently."""
    from inference.model_files import ensure_default_model

    return str(ensure_default_model())


@pytest.fixture(scope="session")
def tiny_server(tiny_model):
    server = ServerThread(
        tiny_model,
        served_model_names=["tiny", "tiny-alias"],
        max_model_len=TINY_MAX_MODEL_LEN,
        num_kv_blocks=TINY_NUM_KV_BLOCKS,
        max_num_seqs=8,
    ).start()
    yield server
    server.stop()
