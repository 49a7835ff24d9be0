"""Prometheus metrics under vLLM's names and labels.

Dashboards, KEDA triggers and inference gateways in the wild read ``vllm:*`` series with a
``model_name`` label, so we export exactly those. The data comes from the engine process
(``inference/engine_core.py``) with every step: gauges are refreshed from the engine's stats
taken after the step, counters advance by the deltas of the engine's running totals, and
the per-request histograms take the latencies the engine process measured right after each
step (TTFT, inter-token, end-to-end, queue) and its finish reasons. The hooks run on the
event loop, once per step message, not once per request.

Names, labels and buckets follow vLLM's ``vllm/v1/metrics/loggers.py``: token-count
histograms use its 1-2-5 buckets up to ``max_model_len`` (so they are made once the engine
has resolved it), a finished request counts in the phase histograms (queue, prefill,
decode, inference) whether it completed or was aborted, and ``time_per_output_token``
observes the same intervals as ``inter_token_latency``, as vLLM's did before it renamed
the metric (dashboards read either). Process metrics (``process_*``) describe the server
process, ``pagoda_engine_process_*`` the engine process, where the model's memory lives.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from inference.engine_messages import EngineInfo, EngineStats, StepTimings

# vLLM exports no `*_created` series; dashboards and recording rules do not expect them.
disable_created_metrics()

# vLLM's buckets, with finer steps below 10 ms for inter-token latency: a GPU decode step
# is a few milliseconds, and vLLM's first ITL bucket (10 ms) would hide all of it.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISHED_REASONS = ("stop", "length", "abort")


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10

# EngineStats running totals -> the counter each one feeds.
_TOTALS = {
    "num_preemptions_total": "num_preemptions",
    "prompt_tokens_total": "prompt_tokens",
    "generation_tokens_total": "generation_tokens",
    "prefix_cache_queries_total": "prefix_cache_queries",
    "prefix_cache_hits_total": "prefix_cache_hits",
    "spec_decode_num_drafts_total": "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens_total": "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens_total": "spec_decode_num_accepted_tokens",
}
_PER_POSITION = "spec_decode_num_accepted_tokens_per_pos_total"


def _running_totals(stats: EngineStats) -> dict[str, float]:
    """Every running total of ``stats`` by key (accepted drafts: one key a position)."""
    totals = {field: getattr(stats, field) for field in _TOTALS}
    for position, value in enumerate(getattr(stats, _PER_POSITION)):
        totals[f"{_PER_POSITION}:{position}"] = value
    return totals


class ServerMetrics:
    """The server's metrics in a registry of their own (tests run several servers in one
    process, and the default registry would mix their series)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(name, doc, labels, buckets=buckets, registry=self.registry)
            return metric.labels(model_name)

        self.num_requests_running = gauge(
            "vllm:num_requests_running", "Requests in the running batch."
        )
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled."
        )
        self.kv_cache_usage_perc = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent."
        )
        # vLLM's LoRA gauge, read by the Gateway API inference extension to route by adapter:
        # the adapters as comma-separated labels, the value the time of the last change.
        # Exported only with LoRA on; one series (the current state), replaced on change.
        self.lora_requests_info = Gauge(
            "vllm:lora_requests_info",
            "Running and waiting LoRA adapters, as labels (value: when they last changed).",
            ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            registry=self.registry,
        )  # fmt: skip
        self._lora_state: tuple | None = None
        self.counters = {
            "num_preemptions": counter(
                "vllm:num_preemptions", "Preemptions (requests evicted to free KV blocks)."
            ),
            "prompt_tokens": counter("vllm:prompt_tokens", "Prefill tokens processed."),
            "generation_tokens": counter("vllm:generation_tokens", "Tokens generated."),
            "prefix_cache_queries": counter(
                "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
            ),
            "prefix_cache_hits": counter(
                "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."
            ),
            "spec_decode_num_drafts": counter(
                "vllm:spec_decode_num_drafts", "Speculative decoding: sequence steps that "
                "verified drafts."),
            "spec_decode_num_draft_tokens": counter(
                "vllm:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens."),
            "spec_decode_num_accepted_tokens": counter(
                "vllm:spec_decode_num_accepted_tokens",
                "Speculative decoding: draft tokens the target accepted."),
        }
        self.spec_decode_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: accepted draft tokens by position.",
            ["model_name", "position"], registry=self.registry,
        )
        success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.request_success = {r: success.labels(model_name, r) for r in FINISHED_REASONS}
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Arrival to last token.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "vllm:time_per_output_token_seconds",
            "Time per output token (the intervals of inter_token_latency).",
            ITL_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Tokens run per engine step.",
            ITERATION_TOKENS_BUCKETS,
        )
        phases = {
            "queue": "Arrival to first scheduled (WAITING phase).",
            "prefill": "First scheduled to first token (PREFILL phase).",
            "decode": "First token to last token (DECODE phase).",
            "inference": "First scheduled to last token (RUNNING phase).",
        }
        self.phases = {
            phase: histogram(
                f"vllm:request_{phase}_time_seconds", doc, REQUEST_LATENCY_BUCKETS
            )
            for phase, doc in phases.items()
        }
        # Made in on_ready: their buckets depend on the resolved max_model_len.
        self.request_prompt_tokens: Any = None
        self.request_generation_tokens: Any = None
        ProcessCollector(registry=self.registry)
        self._engine_info, self._cache_info = self._info_gauges()
        self._last_totals: dict[str, float] = {}

    def _info_gauges(self) -> tuple[Gauge, Gauge]:
        """Settings as labels: the operator and dashboards read the live configuration."""
        engine_info = Gauge(
            "pagoda:engine_config_info",
            "The live engine settings, as labels (value is always 1).",
            [
                "model_name", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                "gpu_memory_utilization", "block_size", "tensor_parallel_size",
                "num_kv_blocks", "enable_prefix_caching", "dtype", "device",
            ],
            registry=self.registry,
        )  # fmt: skip
        cache_info = Gauge(
            "vllm:cache_config_info",
            "KV-cache settings, as labels (value is always 1).",
            [
                "model_name", "block_size", "gpu_memory_utilization",
                "num_gpu_blocks", "enable_prefix_caching", "cache_dtype", "num_gpu_tokens",
            ],
            registry=self.registry,
        )  # fmt: skip
        return engine_info, cache_info

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ----- EngineObserver hooks (event loop, with what the engine process reports) ------

    def on_ready(self, info: EngineInfo, stats: EngineStats) -> None:
        config = info.config
        if self.request_prompt_tokens is None:
            buckets = build_1_2_5_buckets(int(config.max_model_len))
            labels = ["model_name"]
            self.request_prompt_tokens = Histogram(
                "vllm:request_prompt_tokens", "Prompt tokens per finished request.", labels,
                buckets=buckets, registry=self.registry,
            ).labels(self.model_name)  # fmt: skip
            self.request_generation_tokens = Histogram(
                "vllm:request_generation_tokens", "Generated tokens per finished request.",
                labels, buckets=buckets, registry=self.registry,
            ).labels(self.model_name)  # fmt: skip
            engine_pid = info.pid
            ProcessCollector(
                namespace="pagoda_engine", pid=lambda: engine_pid, registry=self.registry
            )
        self.on_config(info)
        # The warm-up request is not traffic: counters start from the engine's totals now.
        self._last_totals = _running_totals(stats)
        self.on_stats(stats, None)

    def on_config(self, info: EngineInfo) -> None:
        """The settings gauges, from the engine's config now (at start and after every live
        change: the old label set goes, so a scrape never shows two configurations)."""
        config = info.config
        self._engine_info.clear()
        self._cache_info.clear()
        num_blocks = "" if info.num_total_blocks is None else str(info.num_total_blocks)
        self._engine_info.labels(
            model_name=self.model_name,
            max_num_seqs=str(config.max_num_seqs),
            max_num_batched_tokens=str(config.max_num_batched_tokens),
            max_model_len=str(config.max_model_len),
            gpu_memory_utilization=str(config.gpu_memory_utilization),
            block_size=str(config.block_size),
            tensor_parallel_size=str(config.tensor_parallel_size),
            num_kv_blocks=num_blocks,
            enable_prefix_caching=str(config.enable_prefix_caching),
            # The resolved values ("auto" says nothing about what is running).
            dtype=info.dtype,
            device=info.device,
        ).set(1)
        self._cache_info.labels(
            model_name=self.model_name,
            block_size=str(config.block_size),
            gpu_memory_utilization=str(config.gpu_memory_utilization),
            num_gpu_blocks=num_blocks,
            enable_prefix_caching=str(config.enable_prefix_caching),
            # The resolved dtype (the model's, or float8_e4m3fn) and the tokens it holds.
            cache_dtype=info.kv_cache_dtype,
            num_gpu_tokens="" if info.num_total_blocks is None
            else str(info.num_total_blocks * config.block_size),
        ).set(1)

    def on_stats(self, stats: EngineStats, timings: StepTimings | None) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self._set_lora_info(stats)
        for key, value in _running_totals(stats).items():
            delta = value - self._last_totals.get(key, 0)
            if delta > 0:
                if key in _TOTALS:
                    self.counters[_TOTALS[key]].inc(delta)
                else:
                    position = key.rsplit(":", 1)[1]
                    self.spec_decode_accepted_per_pos.labels(self.model_name, position).inc(
                        delta)
            self._last_totals[key] = value
        if timings is None:
            return
        observe_many(self.ttft, timings.ttft)
        observe_many(self.itl, timings.itl)
        observe_many(self.tpot, timings.itl)
        observe_many(self.iteration_tokens, timings.iteration_tokens)
        observe_many(self.e2e, timings.e2e)
        for phase, histogram in self.phases.items():
            observe_many(histogram, getattr(timings, phase))
        if self.request_prompt_tokens is not None:
            observe_many(self.request_prompt_tokens, timings.prompt_tokens)
            observe_many(self.request_generation_tokens, timings.generation_tokens)
        for reason, count in timings.finished.items():
            counter = self.request_success.get(reason)
            if counter is not None:
                counter.inc(count)

    def _set_lora_info(self, stats: EngineStats) -> None:
        if not stats.max_lora:
            return
        state = (",".join(stats.running_lora_adapters), ",".join(stats.waiting_lora_adapters),
                 str(stats.max_lora))  # fmt: skip
        if state == self._lora_state:
            return
        self._lora_state = state
        self.lora_requests_info.clear()
        self.lora_requests_info.labels(*state).set_to_current_time()


def observe_many(histogram: Any, values: list[float]) -> None:
    """``histogram.observe`` for each value, with one lock round per touched bucket instead
    of per value: a step of a large batch brings hundreds of inter-token latencies."""
    if not values:
        return
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(values) < 4:
        for value in values:
            histogram.observe(value)
        return
    counts: dict[int, int] = {}
    for value in values:
        index = bisect_left(bounds, value)
        counts[index] = counts.get(index, 0) + 1
    total.inc(sum(values))
    for index, count in counts.items():
        buckets[index].inc(count)
