"""Per-request metrics as vLLM exports them, read straight from /metrics: token counts,
phases and latencies of every finished request, aborted ones included."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def samples(base_url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(all_samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": "tiny", **labels}.items())))
    return all_samples.get(key, 0.0)


def test_request_histograms_count_finished_and_aborted_requests(tiny_server):
    base_url = tiny_server.base_url
    tiny_server.wait_idle()
    before = samples(base_url)
    body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 7, "ignore_eos": True}
    assert httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).status_code == 200
    # A stream the client leaves after its first chunk: the engine aborts it.
    long_body = {**body, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=long_body, timeout=60) as r:
        next(r.iter_lines())
    deadline = time.monotonic() + 30
    while True:
        after = samples(base_url)
        aborted = value(after, "vllm:request_success_total", finished_reason="abort")
        if aborted > value(before, "vllm:request_success_total", finished_reason="abort"):
            break
        assert time.monotonic() < deadline, "the aborted request was never counted"
        time.sleep(0.1)

    def grew(name: str) -> float:
        return value(after, name) - value(before, name)

    for name in (
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_decode_time_seconds_count",
        "vllm:request_inference_time_seconds_count",
        "vllm:request_prompt_tokens_count",
        "vllm:request_generation_tokens_count",
    ):
        assert grew(name) == 2, name  # the finished request and the aborted one
    assert grew("vllm:request_prompt_tokens_sum") == 10
    assert grew("vllm:request_generation_tokens_sum") >= 8  # 7, and at least one
    assert grew("vllm:time_per_output_token_seconds_count") == grew(
        "vllm:inter_token_latency_seconds_count"
    ) >= 6
    assert grew("vllm:iteration_tokens_total_count") >= 7
    assert grew("vllm:iteration_tokens_total_sum") >= 10 + 7
    bucket = value(after, "vllm:request_prompt_tokens_bucket", le="5.0")
    assert bucket >= 2  # 1-2-5 buckets: both prompts have 5 tokens
    info = [k for k in after if k[0] == "vllm:cache_config_info"]
    assert info and dict(info[0][1])["num_gpu_blocks"] == "64"
    # The resolved cache dtype (the model's on this float32 CPU engine) and its tokens.
    assert dict(info[0][1])["cache_dtype"] == "float32"
    assert int(dict(info[0][1])["num_gpu_tokens"]) == 64 * 16
    assert any(k[0] == "process_resident_memory_bytes" for k in after)
    assert any(k[0] == "pagoda_engine_process_resident_memory_bytes" for k in after)
