"""The operator's decisions, as pure functions: spec in, objects / actions / status out."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagoda_operator import constants as c
from pagoda_operator.desired import desired_objects, effective_replicas
from pagoda_operator.engine_args import gpu_count, serve_args
from pagoda_operator.metadata import owner_reference, selector_string
from pagoda_operator.plan import (
    ObjectKey,
    describe_flag_changes,
    object_key,
    parse_flags,
    plan_actions,
)
from pagoda_operator.spec import validate_spec, with_defaults
from pagoda_operator.status import (
    merge_conditions,
    phase_event,
    spec_problem_status,
    status_differs,
    workload_status,
)

from .crd_schema import validation_errors

NOW = "2025-01-01T00:00:00Z"
LATER = "2025-01-01T00:05:00Z"


def llmd(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "metadata": {"name": "qwen", "namespace": "ml", "uid": "uid-1", "generation": 3},
        "spec": {"model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, **spec},
    }


def objects_by_kind(obj: dict[str, Any], **kwargs: Any) -> dict[str, dict[str, Any]]:
    kwargs.setdefault("service_monitor_api", False)
    return {o["kind"]: o for o in desired_objects(obj, **kwargs)}


def flags(args: list[str]) -> dict[str, str]:
    return parse_flags(args)


# --- spec -----------------------------------------------------------------------------------


def test_defaults_fill_only_missing_fields() -> None:
    spec = with_defaults({"model": {"name": "m"}, "engine": {"maxNumSeqs": 8}})
    assert spec["engine"]["maxNumSeqs"] == 8
    assert spec["engine"]["tensorParallelSize"] == 1
    assert spec["engine"]["gpuMemoryUtilization"] == 0.9
    assert spec["replicas"] == 1
    assert spec["tuning"]["mode"] == "Off"


def test_valid_spec_has_no_errors() -> None:
    assert validate_spec(with_defaults(llmd()["spec"])) == []


def test_each_invalid_field_is_named() -> None:
    spec = with_defaults(
        {
            "model": {"name": ""},
            "replicas": -1,
            "engine": {
                "tensorParallelSize": 3,
                "gpuMemoryUtilization": 0,
                "maxNumSeqs": 0,
                "blockSize": 24,
                "toolCallParser": "mistral",
                "extraArgs": ["--max-num-seqs=4", "--tool-call-parser=hermes"],
            },
            "autoscaling": {"minReplicas": 5, "maxReplicas": 2},
            "tuning": {"mode": "Auto"},
        }
    )
    text = "\n".join(validate_spec(spec))
    for field in (
        "spec.model.name",
        "spec.replicas",
        "spec.engine.tensorParallelSize",
        "spec.engine.gpuMemoryUtilization",
        "spec.engine.maxNumSeqs",
        "spec.engine.blockSize",
        "spec.engine.extraArgs: --max-num-seqs",
        "spec.engine.toolCallParser: must be one of hermes, llama3_json (got 'mistral')",
        "spec.engine.extraArgs: --tool-call-parser",
        "spec.autoscaling: minReplicas must be <= maxReplicas",
        "spec.prometheus.url",
    ):
        assert field in text


def test_gpu_limit_that_disagrees_with_tensor_parallel_size_is_refused() -> None:
    spec = with_defaults(
        {
            "model": {"name": "m"},
            "engine": {"tensorParallelSize": 2},
            "resources": {"limits": {"nvidia.com/gpu": 1}},
        }
    )
    assert any("nvidia.com/gpu" in error for error in validate_spec(spec))


engine_values = st.fixed_dictionaries(
    {},
    optional={
        "tensorParallelSize": st.sampled_from([0, 1, 2, 3, 4, 8, 16]),
        "gpuMemoryUtilization": st.sampled_from([0, 0.05, 0.5, 0.9, 1, 1.01]),
        "maxNumSeqs": st.integers(-1, 600),
        "maxNumBatchedTokens": st.integers(-1, 600),
        "blockSize": st.sampled_from([0, 1, 3, 16, 24, 128, 256, 512]),
        "dtype": st.sampled_from(["auto", "bfloat16", "float8"]),
        "device": st.sampled_from(["auto", "cuda", "cpu"]),
        "toolCallParser": st.sampled_from(["hermes", "llama3_json", "mistral"]),
    },
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine=engine_values, replicas=st.integers(-1, 3))
def test_operator_and_crd_agree_on_engine_settings(
    crd: dict[str, Any], engine: dict[str, Any], replicas: int
) -> None:
    """Whatever the API server admits, the operator deploys, and the other way round."""
    obj = llmd(engine=engine, replicas=replicas)
    admitted = validation_errors(crd, obj) == []
    deployable = validate_spec(with_defaults(obj["spec"])) == []
    assert admitted == deployable, (
        validation_errors(crd, obj),
        validate_spec(with_defaults(obj["spec"])),
    )


# --- engine arguments -----------------------------------------------------------------------


def test_serve_args_carry_every_engine_field() -> None:
    spec = with_defaults(
        {
            "model": {"name": "qwen", "servedModelName": "chat"},
            "engine": {
                "tensorParallelSize": 4,
                "gpuMemoryUtilization": 0.85,
                "maxNumSeqs": 128,
                "maxNumBatchedTokens": 4096,
                "blockSize": 32,
                "maxModelLen": 8192,
                "dtype": "bfloat16",
                "maxQueueLen": 100,
                "toolCallParser": "hermes",
                "enablePrefixCaching": False,
                "extraArgs": ["--seed", "7"],
            },
        }
    )
    args = serve_args(spec)
    assert args[:2] == ["serve", "default"]
    assert flags(args) | {} == {
        "<arg 0>": "serve",
        "<arg 1>": "default",
        "--host": "0.0.0.0",
        "--port": "8000",
        "--served-model-name": "chat",
        "--tensor-parallel-size": "4",
        "--gpu-memory-utilization": "0.85",
        "--max-num-seqs": "128",
        "--block-size": "32",
        "--dtype": "bfloat16",
        "--device": "auto",
        "--max-num-batched-tokens": "4096",
        "--max-model-len": "8192",
        "--max-queue-len": "100",
        "--enable-auto-tool-choice": "",
        "--tool-call-parser": "hermes",
        "--no-enable-prefix-caching": "",
        "--shutdown-grace-seconds": "120",
        "--seed": "7",
    }


def test_tool_calling_is_off_unless_a_parser_is_named() -> None:
    args = serve_args(with_defaults({"model": {"name": "m"}}))
    assert "--tool-call-parser" not in args and "--enable-auto-tool-choice" not in args


def test_model_argument_follows_the_weights() -> None:
    def model_arg(source: dict[str, Any] | None) -> str:
        model = {"name": "m"} | ({"source": source} if source is not None else {})
        return serve_args(with_defaults({"model": model}))[1]

    assert model_arg(None) == "default"
    assert model_arg({"image": {"path": "/opt/weights"}}) == "/opt/weights"
    assert model_arg({"pvc": {"claimName": "w"}}) == "/models"
    assert model_arg({"hostPath": {"path": "/data/m"}}) == "/models"


def test_gpus_equal_tensor_parallel_size_except_on_cpu() -> None:
    assert gpu_count(with_defaults({"engine": {"tensorParallelSize": 8}})) == 8
    assert gpu_count(with_defaults({"engine": {"device": "cpu"}})) == 0


def test_api_key_comes_from_the_secret_not_the_spec() -> None:
    obj = llmd(engine={"apiKeySecretRef": {"name": "keys", "key": "pagoda"}})
    container = objects_by_kind(obj)["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    # Through the environment only: an argument (even "$(PAGODA_API_KEY)", which kubelet
    # expands) shows the key in `ps` on the node.
    assert not any("api-key" in arg or "API_KEY" in arg for arg in container["args"])
    assert {
        "name": "PAGODA_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "keys", "key": "pagoda"}},
    } in container["env"]


# --- desired objects ------------------------------------------------------------------------


def test_deployment_shape() -> None:
    obj = llmd(
        replicas=2,
        engine={"tensorParallelSize": 2},
        model={"name": "q", "source": {"pvc": {"claimName": "weights", "subPath": "q"}}},
        nodeSelector={"gpu": "h200"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        runtimeClassName="nvidia",
        resources={"requests": {"memory": "64Gi"}},
    )
    deployment = objects_by_kind(obj)["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert deployment["spec"]["replicas"] == 2
    assert container["resources"] == {
        "requests": {"memory": "64Gi", "nvidia.com/gpu": 2},
        "limits": {"nvidia.com/gpu": 2},
    }
    assert pod["nodeSelector"] == {"gpu": "h200"}
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["automountServiceAccountToken"] is False
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "weights", "readOnly": True},
    } in pod["volumes"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True, "subPath": "q"} in container[
        "volumeMounts"
    ]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]


def test_startup_probe_allows_the_whole_startup_timeout() -> None:
    container = objects_by_kind(llmd(startupTimeoutSeconds=3605))["Deployment"]["spec"]["template"][
        "spec"
    ]["containers"][0]
    probe = container["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 3605


def test_optional_objects() -> None:
    assert set(objects_by_kind(llmd())) == {"Deployment", "Service"}
    assert "PodDisruptionBudget" in objects_by_kind(llmd(replicas=3))
    assert "ServiceMonitor" in objects_by_kind(llmd(), service_monitor_api=True)
    autoscaled = objects_by_kind(
        llmd(
            autoscaling={
                "enabled": True,
                "minReplicas": 1,
                "maxReplicas": 4,
                "targetKVCacheUsage": 0.8,
            }
        )
    )
    hpa = autoscaled["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "name": "qwen",
    }
    assert [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]] == [
        "vllm_num_requests_waiting",
        "vllm_kv_cache_usage_perc",
    ]
    assert hpa["spec"]["metrics"][1]["pods"]["target"]["averageValue"] == "800m"
    # Autoscaled to at most 4: a disruption budget protects the replicas.
    assert "PodDisruptionBudget" in autoscaled


def test_replicas_stay_within_autoscaling_bounds() -> None:
    spec = with_defaults(
        {"replicas": 9, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 4}}
    )
    assert effective_replicas(spec) == 4
    spec["replicas"] = 0
    assert effective_replicas(spec) == 2


def test_every_object_is_owned_and_hashed() -> None:
    obj = llmd(replicas=2)
    for desired in desired_objects(obj, service_monitor_api=True):
        assert desired["metadata"]["ownerReferences"] == [owner_reference(obj)]
        assert desired["metadata"]["labels"][c.LABEL_MANAGED_BY] == c.OPERATOR_NAME
        assert len(desired["metadata"]["annotations"][c.ANNOTATION_CONFIG_HASH]) == 16


def test_config_hash_changes_with_the_spec_only() -> None:
    def deployment_hash(obj: dict[str, Any]) -> str:
        return objects_by_kind(obj)["Deployment"]["metadata"]["annotations"][
            c.ANNOTATION_CONFIG_HASH
        ]

    base = deployment_hash(llmd())
    assert deployment_hash(llmd()) == base
    assert deployment_hash(llmd(engine={"maxNumSeqs": 64})) != base


# --- plan -----------------------------------------------------------------------------------


def existing_from(desired: list[dict[str, Any]]) -> dict[ObjectKey, dict[str, Any] | None]:
    return {object_key(o): o for o in desired}


def test_plan_creates_what_is_missing() -> None:
    desired = desired_objects(llmd(), service_monitor_api=False)
    actions = plan_actions(desired, {}, "uid-1")
    assert [(a.verb, a.kind) for a in actions] == [("create", "Deployment"), ("create", "Service")]


def test_plan_is_empty_when_everything_is_as_desired() -> None:
    desired = desired_objects(llmd(), service_monitor_api=False)
    assert plan_actions(desired, existing_from(desired), "uid-1") == []


def test_plan_updates_changed_objects_and_says_what_changed() -> None:
    before = desired_objects(llmd(), service_monitor_api=False)
    after = desired_objects(llmd(engine={"maxNumSeqs": 64}), service_monitor_api=False)
    (action,) = plan_actions(after, existing_from(before), "uid-1")
    assert (action.verb, action.kind) == ("update", "Deployment")
    assert action.event_message == "Updated Deployment qwen: --max-num-seqs 1024 -> 64"


def test_plan_deletes_objects_no_longer_wanted() -> None:
    before = desired_objects(llmd(replicas=2), service_monitor_api=False)
    after = desired_objects(llmd(replicas=1), service_monitor_api=False)
    verbs = [(a.verb, a.kind) for a in plan_actions(after, existing_from(before), "uid-1")]
    assert ("delete", "PodDisruptionBudget") in verbs
    assert ("update", "Deployment") in verbs


def test_plan_never_touches_objects_owned_by_someone_else() -> None:
    desired = desired_objects(llmd(), service_monitor_api=False)
    foreign = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "qwen", "ownerReferences": []},
    }
    actions = plan_actions(desired, {("v1", "Service", "qwen"): foreign}, "uid-1")
    assert [(a.verb, a.kind) for a in actions] == [("conflict", "Service")]


@given(st.lists(st.sampled_from(["--a", "--b", "1", "2", "--c=3"]), max_size=8))
def test_unchanged_flags_describe_no_change(args: list[str]) -> None:
    assert describe_flag_changes(args, args) == []


# --- status ---------------------------------------------------------------------------------


def deployment_with(**status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "qwen", "generation": 2},
        "status": {"observedGeneration": 2, **status},
    }


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {cond["type"]: (cond["status"], cond["reason"]) for cond in status["conditions"]}


def test_status_while_loading_the_model() -> None:
    status = workload_status(llmd(replicas=2), deployment_with(replicas=2, updatedReplicas=2), NOW)
    assert status["phase"] == "Progressing"
    assert conditions(status) == {
        "Available": ("False", "NoReplicaReady"),
        "Progressing": ("True", "RollingOut"),
        "Degraded": ("False", "AsExpected"),
    }
    assert status["observedGeneration"] == 3
    assert status["selector"] == selector_string("qwen")


def test_status_when_all_replicas_are_ready() -> None:
    ready = deployment_with(replicas=2, updatedReplicas=2, readyReplicas=2)
    status = workload_status(llmd(replicas=2), ready, NOW)
    assert status["phase"] == "Available"
    assert conditions(status)["Available"] == ("True", "ReplicasReady")
    assert conditions(status)["Progressing"] == ("False", "RolloutComplete")


def test_status_waits_for_the_deployment_controller() -> None:
    stale = {
        "metadata": {"generation": 3},
        "status": {
            "observedGeneration": 2,
            "replicas": 1,
            "updatedReplicas": 1,
            "readyReplicas": 1,
        },
    }
    assert workload_status(llmd(), stale, NOW)["phase"] == "Progressing"


def test_status_reports_a_stuck_rollout_as_degraded() -> None:
    stuck = deployment_with(
        conditions=[
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": "ReplicaSet qwen-abc has timed out progressing.",
            }
        ]
    )
    status = workload_status(llmd(), stuck, NOW)
    assert status["phase"] == "Degraded"
    assert conditions(status)["Degraded"] == ("True", "ProgressDeadlineExceeded")


def test_invalid_spec_status_keeps_serving_conditions() -> None:
    serving = llmd()
    serving["status"] = workload_status(
        serving, deployment_with(replicas=1, updatedReplicas=1, readyReplicas=1), NOW
    )
    status = spec_problem_status(
        serving, "InvalidSpec", "spec.engine.maxNumSeqs: must be >= 1", LATER
    )
    assert status["phase"] == "Degraded"
    assert conditions(status)["Degraded"] == ("True", "InvalidSpec")
    assert conditions(status)["Available"] == ("True", "ReplicasReady")
    serving["status"] = status
    # The Deployment reporting in does not hide the spec problem of this generation.
    again = workload_status(serving, deployment_with(replicas=1, readyReplicas=1), LATER)
    assert conditions(again)["Degraded"] == ("True", "InvalidSpec")
    assert (
        conditions(workload_status(serving, None, LATER, keep_spec_problem=False))["Degraded"][0]
        == "False"
    )


def test_transition_time_moves_only_when_the_status_flips() -> None:
    first = merge_conditions(
        [], [{"type": "Available", "status": "False", "reason": "a", "message": ""}], NOW
    )
    same = merge_conditions(
        first, [{"type": "Available", "status": "False", "reason": "b", "message": ""}], LATER
    )
    flipped = merge_conditions(
        first, [{"type": "Available", "status": "True", "reason": "c", "message": ""}], LATER
    )
    assert same[0]["lastTransitionTime"] == NOW
    assert flipped[0]["lastTransitionTime"] == LATER


def test_unchanged_status_is_not_patched_again() -> None:
    obj = llmd()
    obj["status"] = workload_status(obj, deployment_with(replicas=1), NOW)
    assert not status_differs(
        obj["status"], workload_status(obj, deployment_with(replicas=1), LATER)
    )


def test_phase_events() -> None:
    status = {
        "phase": "Available",
        "conditions": [
            {
                "type": "Available",
                "status": "True",
                "reason": "ReplicasReady",
                "message": "1/1 replicas ready",
            }
        ],
    }
    assert phase_event("Progressing", status) == (
        "Normal",
        "PhaseAvailable",
        "Phase Progressing -> Available: 1/1 replicas ready",
    )
    assert phase_event("Available", status) is None


def test_service_monitor_labels_series_with_the_llmdeployment():
    from pagoda_operator.desired import desired_service_monitor

    monitor = desired_service_monitor(llmd())
    relabel = monitor["spec"]["endpoints"][0]["relabelings"][0]
    assert relabel == {
        "sourceLabels": ["__meta_kubernetes_pod_label_pagoda_dev_llmdeployment"],
        "targetLabel": "llmdeployment",
    }
