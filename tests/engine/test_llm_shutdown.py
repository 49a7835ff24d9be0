"""``LLM.shutdown()`` (and leaving ``with LLM(...)``) gives back what the engine holds: the
weights, the KV cache and the graphs. Later calls raise a clear error, and a second
``LLM()`` in the same process works (on a GPU the first one's KV cache would otherwise
leave "no GPU memory left for the KV cache")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inference import LLM, SamplingParams
from inference.model_files import ensure_default_model

MIB = 1024 * 1024
KV_GIB = 1.0


def _new_llm() -> LLM:
    # A 1 GiB KV cache on CPU, written to by a request so that its pages are resident.
    return LLM("default", device="cpu", max_model_len=512, cpu_kv_cache_gib=KV_GIB)


# Memory is measured in a process of its own: in a long test session the allocator holds
# pages that earlier tests freed, and a new engine reuses them without growing the RSS.
_MEASURE = """
import gc, json, psutil
from inference import LLM, SamplingParams
def rss():
    gc.collect()
    return psutil.Process().memory_info().rss
before = rss()
llm = LLM("default", device="cpu", max_model_len=512, cpu_kv_cache_gib=%r)
llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
loaded = rss()
llm.shutdown()
after = rss()
refused = 0
for call in (lambda: llm.generate("Hello", use_tqdm=False),
             lambda: llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)):
    try:
        call()
    except RuntimeError as exc:
        refused += "shut down" in str(exc)
llm.shutdown()  # twice is fine
print(json.dumps({"before": before, "loaded": loaded, "after": after, "refused": refused}))
"""


def test_shutdown_frees_the_engine_and_later_calls_raise() -> None:
    ensure_default_model()  # a first conversion would count its own memory
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", _MEASURE % KV_GIB], capture_output=True,
                            text=True, timeout=600, cwd=root, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    m = json.loads(result.stdout.strip().splitlines()[-1])
    grown = m["loaded"] - m["before"]
    assert grown > 500 * MIB  # weights (~540 MB float32) and the touched cache
    freed = m["loaded"] - m["after"]
    # Generous: the allocator may keep some pages; most of the weights must go back.
    assert freed > 0.5 * grown, f"only {freed / MIB:.0f} MiB of {grown / MIB:.0f} MiB freed"
    assert m["refused"] == 2  # generate and chat after shutdown raise, saying why


def test_a_second_llm_after_leaving_the_first() -> None:
    with _new_llm() as first:
        first.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(RuntimeError, match="shut down"):
        first.generate("Hi", use_tqdm=False)
    with _new_llm() as second:
        out = second.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
