"""The engine's ``/metrics`` against the Gateway API inference extension's model-server
protocol: the series its endpoint picker (EPP) scrapes to route each request to a replica.

The protocol (vendored under ``data/gateway-api-inference-extension``) lists, per model
server, the metric names the EPP reads: queue, running batch and KV-cache utilisation
(required), the KV-cache block size and block count as labels of ``vllm:cache_config_info``
(optional), and ``vllm:lora_requests_info`` for servers that serve LoRA adapters.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = Path(__file__).parent / "data/gateway-api-inference-extension/model-server-protocol.md"
SERVER_METRICS = ROOT / "inference/server/metrics.py"

# What pagoda does not serve yet, and why (nothing now).
NOT_YET: dict[str, str] = {}


def protocol_vllm_metrics() -> tuple[set[str], dict[str, set[str]]]:
    """The vLLM metric names the protocol lists, and the labels it reads of labelled ones."""
    text = PROTOCOL.read_text()
    rows = [line for line in text.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in rows[0].strip("|").split("|")]
    column = header.index("vLLM metric")
    names: set[str] = set()
    labels: dict[str, set[str]] = {}
    for row in rows[2:]:
        cell = row.strip("|").split("|")[column]
        found = re.findall(r"`(vllm:[a-z_]+)`", cell)
        names.update(found)
        label = re.search(r"label name: `([a-z_]+)`", cell)
        if label:
            labels.setdefault(found[0], set()).add(label.group(1))
    names.update(re.findall(r"Metric name implemented in vLLM: `(vllm:[a-z_]+)`", text))
    return names, labels


def served_metrics() -> tuple[set[str], dict[str, set[str]]]:
    """The vLLM names the engine's server registers, and the labels of each (by reading its
    source: the layers keep tests of the operator's contract off the engine's imports)."""
    source = SERVER_METRICS.read_text()
    names = set(re.findall(r'"(vllm:[a-z_]+)"', source))
    labels = {}
    for name, body in re.findall(r'"(vllm:[a-z_]+)",\s*"[^"]*",\s*\[([^\]]*)\]', source):
        labels[name] = set(re.findall(r'"([a-z_]+)"', body))
    return names, labels


def test_the_protocol_lists_what_the_epp_scrapes() -> None:
    names, labels = protocol_vllm_metrics()
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running",
            "vllm:kv_cache_usage_perc", "vllm:cache_config_info",
            "vllm:lora_requests_info"} <= names  # fmt: skip
    assert labels["vllm:cache_config_info"] == {"block_size", "num_gpu_blocks"}


def test_the_engine_serves_every_protocol_metric() -> None:
    wanted, wanted_labels = protocol_vllm_metrics()
    served, served_labels = served_metrics()
    assert wanted - served == set(NOT_YET), f"missing from /metrics: {wanted - served}"
    for name, labels in wanted_labels.items():
        assert labels <= served_labels[name], f"{name} lacks labels {labels - served_labels[name]}"


def test_lora_info_has_the_labels_the_protocol_reads() -> None:
    """The protocol's LoRA section names three labels of ``vllm:lora_requests_info``: the
    adapters running and waiting (comma-separated) and ``max_lora``."""
    text = PROTOCOL.read_text()
    section = text[text.index("vllm:lora_requests_info"):]
    wanted = {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    assert all(f"`{label}`" in section for label in wanted)
    _, served_labels = served_metrics()
    assert served_labels["vllm:lora_requests_info"] == wanted
