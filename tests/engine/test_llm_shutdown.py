"""``LLM.shutdown()`` (and leaving ``with LLM(...)``) gives back what the engine holds: the
weights, the KV cache and the graphs. Later calls raise a clear error, and a second
``LLM()`` in the same process works (on a GPU the first one's KV cache would otherwise
leave "no GPU memory left for the KV cache")."""

from __future__ import annotations

import gc

import psutil
import pytest

from inference import LLM, SamplingParams
from inference.model_files import ensure_default_model

MIB = 1024 * 1024
KV_GIB = 1.0


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def _new_llm() -> LLM:
    # A 1 GiB KV cache on CPU, written to by a request so that its pages are resident.
    return LLM("default", device="cpu", max_model_len=512, cpu_kv_cache_gib=KV_GIB)


def test_shutdown_frees_the_engine_and_later_calls_raise() -> None:
    ensure_default_model()  # a first conversion would count its own memory
    before = _rss()
    llm = _new_llm()
    llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    loaded = _rss()
    assert loaded - before > 500 * MIB  # weights (~540 MB float32) and the touched cache
    llm.shutdown()
    freed = loaded - _rss()
    # Generous: the allocator may keep some pages; most of the weights must go back.
    assert freed > 0.5 * (loaded - before), f"only {freed / MIB:.0f} MiB of " \
        f"{(loaded - before) / MIB:.0f} MiB freed"
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    llm.shutdown()  # twice is fine


def test_a_second_llm_after_leaving_the_first() -> None:
    with _new_llm() as first:
        first.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(RuntimeError, match="shut down"):
        first.generate("Hi", use_tqdm=False)
    with _new_llm() as second:
        out = second.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
