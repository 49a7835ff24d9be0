"""The contract between the operator and the engine: every flag the operator can put on a
Deployment parses with the real ``pagoda serve`` parser into the settings the LLMDeployment
asked for, and the CRD's defaults (plain manifest and Helm copy) are the engine's.

The operator never imports the engine; only this test reads both sides.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml
from pagoda_operator import constants
from pagoda_operator import spec as operator_spec
from pagoda_operator.desired import desired_objects

from inference import config as engine_config_module
from inference.config import EngineConfig, ResolvedEngineConfig
from inference.model_shapes import SHAPES
from inference.models.config import ModelConfig
from inference.server.cli_serve import add_serve_args, engine_config, served_names
from inference.server.tool_parsers import TOOL_PARSERS
from inference.spec_decode.config import SpeculativeConfig

ROOT = Path(__file__).resolve().parent.parent
CRD_COPIES = {
    "manifests": ROOT / "manifests" / "crd.yaml",
    "helm": ROOT / "helm" / "pagoda-operator" / "crds" / "llmdeployments.pagoda.dev.yaml",
}
MODEL = ModelConfig.from_dict(SHAPES["qwen2.5-7b"])  # 32768 positions

# Every engine knob the LLMDeployment has, each set away from its default.
EVERY_KNOB = {
    "tensorParallelSize": 2,
    "gpuMemoryUtilization": 0.85,
    "maxNumSeqs": 128,
    "maxNumBatchedTokens": 4096,
    "blockSize": 32,
    "maxModelLen": 8192,
    "maxQueueLen": 100,
    "dtype": "bfloat16",
    "kvCacheDtype": "fp8",
    "quantization": "fp8",
    "device": "cuda",
    "enablePrefixCaching": False,
    "toolCallParser": "llama3_json",
    "extraArgs": ["--seed", "7", "--enforce-eager", "--no-async-scheduling"],
}
# LLMDeployment field -> EngineConfig field, for those that are engine settings.
ENGINE_FIELDS = {
    "tensorParallelSize": "tensor_parallel_size",
    "gpuMemoryUtilization": "gpu_memory_utilization",
    "maxNumSeqs": "max_num_seqs",
    "maxNumBatchedTokens": "max_num_batched_tokens",
    "blockSize": "block_size",
    "maxModelLen": "max_model_len",
    "dtype": "dtype",
    "kvCacheDtype": "kv_cache_dtype",
    "quantization": "quantization",
    "device": "device",
    "enablePrefixCaching": "enable_prefix_caching",
}


def deployment_args(engine: dict[str, Any]) -> list[str]:
    """The engine container's arguments the operator renders for this engine spec."""
    llmd = {
        "apiVersion": constants.API_VERSION,
        "kind": constants.KIND,
        "metadata": {"name": "qwen", "namespace": "ml", "uid": "uid-1", "generation": 1},
        "spec": {"model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, "engine": engine},
    }
    (deployment,) = [
        obj for obj in desired_objects(llmd, service_monitor_api=False)
        if obj["kind"] == "Deployment"
    ]  # fmt: skip
    (container,) = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"
    ]
    assert container["command"] == ["pagoda"]
    assert container["args"][0] == "serve"
    return container["args"][1:]


def parse_and_resolve(args: list[str]) -> tuple[argparse.Namespace, ResolvedEngineConfig]:
    parsed = add_serve_args(argparse.ArgumentParser(prog="pagoda serve"))
    namespace = parsed.parse_args(args)
    config = engine_config(namespace, served_names(namespace))
    device = "cpu" if config.device == "cpu" else "cuda"
    return namespace, config.resolve(MODEL, device)


def test_every_flag_the_operator_emits_parses_into_the_asked_settings() -> None:
    namespace, resolved = parse_and_resolve(deployment_args(EVERY_KNOB))
    for knob, name in ENGINE_FIELDS.items():
        assert getattr(resolved, name) == EVERY_KNOB[knob], knob
    assert (resolved.seed, resolved.enforce_eager, resolved.async_scheduling) == (7, True, False)
    assert resolved.served_model_name == "Qwen/Qwen2.5-7B-Instruct"
    assert namespace.max_queue_len == 100 and namespace.port == 8000
    assert namespace.tool_call_parser == "llama3_json" and namespace.enable_auto_tool_choice


def test_no_tool_call_parser_leaves_auto_tool_choice_off() -> None:
    namespace, _ = parse_and_resolve(deployment_args({}))
    assert namespace.tool_call_parser is None and not namespace.enable_auto_tool_choice


@pytest.mark.parametrize("copy_name", sorted(CRD_COPIES))
def test_tool_call_parsers_are_the_servers(copy_name: str) -> None:
    """The CRD, the operator's check and `pagoda serve --tool-call-parser` offer the same."""
    crd_enum = crd_engine_schema(copy_name)["properties"]["toolCallParser"]["enum"]
    assert crd_enum == list(operator_spec.TOOL_CALL_PARSERS) == list(TOOL_PARSERS)


def test_the_operator_manages_only_flags_the_server_knows() -> None:
    parser = add_serve_args(argparse.ArgumentParser())
    known = {option for action in parser._actions for option in action.option_strings}
    assert set(operator_spec.MANAGED_FLAGS) <= known


@pytest.mark.parametrize("device", ["auto", "cuda", "cpu"])
@pytest.mark.parametrize("budget", [None, 64, 100000])
def test_a_spec_without_batch_limits_runs_as_pagoda_serve_would(
    device: str, budget: int | None
) -> None:
    """The operator's defaults give the engine what it resolves with no flags at all."""
    engine = {"device": device} | ({"maxNumBatchedTokens": budget} if budget else {})
    _, from_operator = parse_and_resolve(deployment_args(engine))
    bare = ["default", "--device", device] + (
        ["--max-num-batched-tokens", str(budget)] if budget else []
    )
    _, from_serve = parse_and_resolve(bare)
    assert from_operator.max_num_seqs == from_serve.max_num_seqs
    assert from_operator.max_num_batched_tokens == from_serve.max_num_batched_tokens


def test_operator_default_max_num_seqs_is_the_engines() -> None:
    assert operator_spec.ENGINE_DEFAULT_MAX_NUM_SEQS == engine_config_module.DEFAULT_MAX_NUM_SEQS


def crd_engine_schema(copy_name: str) -> dict[str, Any]:
    document = yaml.safe_load(CRD_COPIES[copy_name].read_text())
    (version,) = document["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["engine"]


@pytest.mark.parametrize("copy_name", sorted(CRD_COPIES))
def test_crd_defaults_are_the_engines(copy_name: str) -> None:
    properties = crd_engine_schema(copy_name)["properties"]
    engine_defaults = {f.name: f.default for f in fields(EngineConfig)}
    for knob, name in ENGINE_FIELDS.items():
        crd_default = properties[knob].get("default")
        if engine_defaults[name] is None:
            # The engine resolves it from the model or the device: the CRD must not pin it.
            assert crd_default is None, knob
        else:
            assert crd_default == engine_defaults[name], knob
    allowed_dtypes = set(EngineConfig.__dataclass_fields__["dtype"].metadata["choices"])
    assert set(properties["dtype"]["enum"]) <= allowed_dtypes
    assert properties["kvCacheDtype"]["enum"] == list(
        EngineConfig.__dataclass_fields__["kv_cache_dtype"].metadata["choices"]
    )
    assert properties["quantization"]["enum"] == list(operator_spec.QUANTIZATION_METHODS) == list(
        EngineConfig.__dataclass_fields__["quantization"].metadata["choices"]
    )
    assert properties["device"]["enum"] == list(
        EngineConfig.__dataclass_fields__["device"].metadata["choices"]
    )


def test_default_kv_cache_dtype_adds_no_flag() -> None:
    """Deployments made before kvCacheDtype existed keep their arguments (no rollout on an
    operator upgrade); the engine's default is the CRD's."""
    assert "--kv-cache-dtype" not in deployment_args({})
    assert "--quantization" not in deployment_args({})
    _, resolved = parse_and_resolve(deployment_args({}))
    assert resolved.kv_cache_dtype == "auto" and resolved.quantization is None


def test_quantization_reaches_the_engine_and_bad_values_are_refused() -> None:
    """spec.engine.quantization becomes --quantization; the operator's own check refuses
    what the CRD's enum would (the spec validated before any Deployment is written)."""
    args = deployment_args({"quantization": "awq"})
    assert args[args.index("--quantization") + 1] == "awq"
    errors = operator_spec.validate_spec(operator_spec.with_defaults(
        {"model": {"name": "m"}, "engine": {"quantization": "int4"}}))
    assert any(e.startswith("spec.engine.quantization: must be one of fp8, awq") for e in errors)
    assert operator_spec.validate_spec(operator_spec.with_defaults(
        {"model": {"name": "m"}, "engine": {"quantization": "gptq"}})) == []


@pytest.mark.parametrize("speculative, expected", [
    ({"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMin": 2, "promptLookupMax": 4},
     SpeculativeConfig("ngram", 4, prompt_lookup_max=4, prompt_lookup_min=2)),
    ({"method": "ngram", "numSpeculativeTokens": 3, "disableByBatchSize": 8},
     SpeculativeConfig("ngram", 3, 5, 5, disable_by_batch_size=8)),
    ({"method": "draft_model", "numSpeculativeTokens": 5, "draftModel": "/models/draft"},
     SpeculativeConfig("draft_model", 5, model="/models/draft")),
    ({"method": "eagle", "numSpeculativeTokens": 3, "draftModel": "/models/eagle-head"},
     SpeculativeConfig("eagle", 3, model="/models/eagle-head")),
    ({"method": "eagle3", "numSpeculativeTokens": 3, "draftModel": "/models/eagle3-head"},
     SpeculativeConfig("eagle3", 3, model="/models/eagle3-head")),
])
def test_speculative_reaches_the_engine_as_asked(speculative, expected) -> None:
    args = deployment_args({"speculative": speculative})
    _, resolved = parse_and_resolve(args)
    assert resolved.speculative() == expected
    assert "--speculative-config" not in deployment_args({})


def test_speculative_methods_and_refusals_are_the_engines() -> None:
    from inference.spec_decode.config import SUPPORTED_METHODS

    for copy_name in CRD_COPIES:
        crd = crd_engine_schema(copy_name)["properties"]["speculative"]["properties"]
        assert crd["method"]["enum"] == list(operator_spec.SPECULATIVE_METHODS)
    assert operator_spec.SPECULATIVE_METHODS == SUPPORTED_METHODS

    def errors(engine):
        return operator_spec.validate_spec(operator_spec.with_defaults(
            {"model": {"name": "m"}, "engine": engine}))

    draft = {"method": "draft_model", "numSpeculativeTokens": 4}
    assert errors({"speculative": {**draft, "draftModel": "/models/draft"}}) == []
    assert errors({"speculative": {**draft, "draftModel": "hf://org/draft"}}) == []
    (message,) = errors({"speculative": {**draft, "draftModel": "gs://bucket/draft"}})
    assert "hf://ORG/NAME" in message and "absolute path" in message
    assert errors({"speculative": draft}) == [
        "spec.engine.speculative.draftModel: required with method draft_model"]
    eagle = {"method": "eagle", "numSpeculativeTokens": 3}
    assert errors({"speculative": {**eagle, "draftModel": "/models/eagle-head"}}) == []
    assert errors({"speculative": eagle}) == [
        "spec.engine.speculative.draftModel: required with method eagle"]
    assert errors({"speculative": {"method": "eagle3", "numSpeculativeTokens": 4}})
    assert errors({"tensorParallelSize": 2, "speculative": {
        "method": "ngram", "numSpeculativeTokens": 4}}) == []
    assert errors({"tensorParallelSize": 2, "speculative": {
        **eagle, "draftModel": "/models/eagle-head"}}) == [
        "spec.engine.speculative: speculative decoding with tensorParallelSize > 1 runs method ngram only"]
    assert errors({"speculative": {**draft, "draftModel": "/d", "promptLookupMax": 3}})


def adapter_args(adapters: list[dict[str, Any]], lora: dict[str, Any]) -> list[str]:
    llmd = {
        "apiVersion": constants.API_VERSION,
        "kind": constants.KIND,
        "metadata": {"name": "qwen", "namespace": "ml", "uid": "uid-1", "generation": 1},
        "spec": {"model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, "adapters": adapters,
                 "engine": {"lora": lora}},
    }  # fmt: skip
    args, _ = pod_command_line(desired_objects(llmd, service_monitor_api=False))
    return args


def pod_command_line(objects: list[dict[str, Any]]) -> tuple[list[str], dict[str, str]]:
    """The engine container's arguments as the kubelet expands their $(VAR) references from
    the container's environment (here its ConfigMap and admin Secret values), and that
    environment."""
    from pagoda_operator import live_settings

    by_kind = {obj["kind"]: obj for obj in objects}
    (container,) = by_kind["Deployment"]["spec"]["template"]["spec"]["containers"]
    sources = {"configMapKeyRef": (by_kind.get("ConfigMap") or {}).get("data") or {},
               "secretKeyRef": {live_settings.ADMIN_SECRET_KEY: "admin-key"}}  # fmt: skip
    env = {}
    for entry in container["env"]:
        if "value" in entry:
            env[entry["name"]] = entry["value"]
            continue
        ((kind, ref),) = entry["valueFrom"].items()
        if kind in sources:
            env[entry["name"]] = sources[kind][ref["key"]]
    args = [env.get(a[2:-1], a) if a.startswith("$(") else a for a in container["args"][1:]]
    return args, env


@pytest.mark.parametrize(
    ("lora", "expected"),
    [({}, (8, 32, 16)), ({"maxLoras": 1, "maxLoraRank": 64, "maxCpuLoras": 4}, (1, 4, 64))],
)
def test_adapters_reach_the_server_as_lora_modules(
    lora: dict[str, Any], expected: tuple[int, int, int]
) -> None:
    """spec.adapters and spec.engine.lora parse into the engine's LoRA settings."""
    from pagoda_operator.adapters import ENGINE_DEFAULT_MAX_LORA_RANK, LORA_FLAGS

    assert EngineConfig("m").max_lora_rank == ENGINE_DEFAULT_MAX_LORA_RANK

    adapters = [{"name": "sql.v2_a-b", "uri": "hf://acme/sql"}, {"name": "x", "uri": "/opt/x"}]
    namespace, resolved = parse_and_resolve(adapter_args(adapters, lora))
    assert resolved.enable_lora
    assert (resolved.max_loras, resolved.max_cpu_loras, resolved.max_lora_rank) == expected
    assert [(m.name, m.path) for m in namespace.lora_modules][1] == ("x", "/opt/x")
    assert namespace.lora_modules[0].name == "sql.v2_a-b"
    assert namespace.lora_modules[0].path.startswith("/adapters/sql.v2_a-b-")
    parser = add_serve_args(argparse.ArgumentParser())
    known = {option for action in parser._actions for option in action.option_strings}
    assert set(LORA_FLAGS) <= known


def test_the_operator_loads_adapters_through_the_admin_routes() -> None:
    """The admin API serves the routes ``adapter_sync`` calls, on the port the pods declare."""
    from pagoda_operator import adapter_sync

    from inference.server.admin import build_admin_app

    paths = set(build_admin_app(object(), "admin-key").openapi()["paths"])  # type: ignore[arg-type]
    assert {adapter_sync.LIST_PATH, adapter_sync.LOAD_PATH, adapter_sync.UNLOAD_PATH} <= paths


def test_a_tuned_deployment_runs_the_settings_in_force_and_the_admin_api() -> None:
    """Tuning Auto: the flags the tuner changes live read the settings ConfigMap through the
    container's environment; expanded as the kubelet expands $(VAR) in args (from env
    entries, here their ConfigMap and Secret values), they parse into the values in force,
    with the admin API on its port and key. The tuner's setting names are the admin API's."""
    from pagoda_operator import live_settings

    from inference.reconfigure import LIVE_SETTINGS
    from inference.server.cli_serve import ADMIN_KEY_ENV, check_serve_args

    llmd = {
        "apiVersion": constants.API_VERSION, "kind": constants.KIND,
        "metadata": {"name": "qwen", "namespace": "ml", "uid": "uid-1", "generation": 1},
        "spec": {"model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, "engine": {"maxNumSeqs": 64},
                 "tuning": {"mode": "Auto"}, "prometheus": {"url": "http://prometheus:9090"}},
        "status": {"tuning": {"overrides": {"maxNumSeqs": {"value": 96, "specValue": 64}}}},
    }  # fmt: skip
    args, env = pod_command_line(desired_objects(llmd, service_monitor_api=False))
    namespace, resolved = parse_and_resolve(args)
    namespace.admin_api_key = env[ADMIN_KEY_ENV]
    assert (resolved.max_num_seqs, resolved.gpu_memory_utilization) == (96, 0.9)
    assert namespace.admin_port == live_settings.ADMIN_PORT and check_serve_args(namespace) == []
    assert live_settings.ADMIN_KEY_ENV == ADMIN_KEY_ENV
    assert set(live_settings.ENGINE_SETTINGS.values()) <= set(LIVE_SETTINGS)
