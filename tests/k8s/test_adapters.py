"""spec.adapters: LoRA adapters delivered by the loader Job and rendered to the engine's
flags, as pure functions (spec in, objects, flags, cache state or problems out)."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest
from pagoda_operator import constants as c
from pagoda_operator.adapters import adapter_folder
from pagoda_operator.desired import desired_objects
from pagoda_operator.engine_args import serve_args
from pagoda_operator.model_cache import cache_state
from pagoda_operator.plan import plan_actions
from pagoda_operator.spec import validate_spec, with_defaults
from pagoda_operator.status import workload_status

from .crd_schema import validation_errors
from .test_manifests import KUBERNETES_VERSIONS

NOW = "2025-01-01T00:00:00Z"
HF_MODEL = {"uri": "hf://Qwen/Qwen2.5-7B-Instruct@v1"}
SQL = {"name": "sql", "uri": "hf://acme/qwen-sql-lora", "credentialsSecret": {"name": "hf"}}
CHAT = {"name": "chat.v2", "uri": "s3://adapters/chat", "endpoint": "http://minio:9000"}
BAKED = {"name": "baked", "uri": "/opt/adapters/baked"}


def llmd(adapters: list[dict[str, Any]], source: dict[str, Any] | None = HF_MODEL,
         **spec: Any) -> dict[str, Any]:  # fmt: skip
    model: dict[str, Any] = {"name": "Qwen/Qwen2.5-7B-Instruct"}
    if source is not None:
        model["source"] = source
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "metadata": {"name": "qwen", "namespace": "ml", "uid": "uid-1", "generation": 1},
        "spec": {"model": model, "adapters": adapters, **spec},
    }


def objects(obj: dict[str, Any], **kwargs: Any) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in desired_objects(obj, service_monitor_api=False, **kwargs)}


def engine(obj: dict[str, Any]) -> dict[str, Any]:
    return objects(obj)["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def lora_modules(obj: dict[str, Any], **kwargs: Any) -> list[str]:
    """``name=path`` of each adapter a starting engine serves (the settings ConfigMap's list,
    which its ``--lora-modules $(PAGODA_LORA_MODULES)`` reads)."""
    data = objects(obj, **kwargs)["ConfigMap"]["data"]
    return [f"{m['name']}={m['path']}" for m in json.loads(data["loraModules"])]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


# --- the engine's flags ---------------------------------------------------------------------


def test_adapters_become_lora_modules_read_from_the_settings_config_map() -> None:
    obj = llmd([SQL, CHAT, BAKED])
    container = engine(obj)
    args = container["args"]
    assert "--enable-lora" in args and flag(args, "--lora-modules") == "$(PAGODA_LORA_MODULES)"
    assert lora_modules(obj) == [
        f"sql=/adapters/{adapter_folder(SQL)}",
        f"chat.v2=/adapters/{adapter_folder(CHAT)}",
        "baked=/opt/adapters/baked",  # a folder already in the container
    ]
    env = {entry["name"]: entry for entry in container["env"]}
    assert env["PAGODA_LORA_MODULES"]["valueFrom"]["configMapKeyRef"] == {
        "name": "qwen-engine-settings", "key": "loraModules"}  # fmt: skip
    # The admin API the operator loads adapters through, behind the engines' own key.
    assert flag(args, "--admin-port") == "8001"
    assert env["PAGODA_ADMIN_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "qwen-engine-admin"
    assert "admin" in {port["name"] for port in container["ports"]}
    # Not tuned: the knobs stay values, and the ConfigMap holds only the adapters.
    assert flag(args, "--max-num-seqs") == "1024"
    assert set(objects(obj)["ConfigMap"]["data"]) == {"loraModules"}
    # Eight slots and room for every adapter a spec may list, whatever the adapters.
    assert (flag(args, "--max-loras"), flag(args, "--max-cpu-loras")) == ("8", "32")
    assert "--max-lora-rank" not in args


def test_the_limits_are_the_spec_s_and_never_follow_the_adapters() -> None:
    many = [{"name": f"a{i}", "uri": f"hf://acme/a{i}"} for i in range(12)]
    assert engine(llmd(many))["args"] == engine(llmd([SQL]))["args"]
    lora = {"maxLoras": 12, "maxLoraRank": 64, "maxCpuLoras": 20}
    args = serve_args(with_defaults(llmd(many, engine={"lora": lora})["spec"]))
    assert [flag(args, f) for f in ("--max-loras", "--max-lora-rank", "--max-cpu-loras")] == [
        "12", "64", "20"]  # fmt: skip
    # maxCpuLoras alone caps the slots: the engine refuses max_cpu_loras < max_loras.
    args = serve_args(with_defaults(llmd(many[:2], engine={"lora": {"maxCpuLoras": 2}})["spec"]))
    assert (flag(args, "--max-loras"), flag(args, "--max-cpu-loras")) == ("2", "2")


def test_adding_changing_or_removing_an_adapter_keeps_the_pod_template() -> None:
    """What the engines cannot change live rolls them; the adapter list never does."""
    moved = {**SQL, "uri": "hf://acme/qwen-sql-lora@v2"}
    lists = ([SQL], [SQL, CHAT], [moved, CHAT], [CHAT, BAKED], [BAKED])
    templates = {json.dumps(objects(llmd(adapters))["Deployment"]["spec"]["template"],
                            sort_keys=True) for adapters in lists}  # fmt: skip
    assert len(templates) == 1
    assert len({json.dumps(objects(llmd(a))["ConfigMap"]["data"]) for a in lists}) == len(lists)
    # spec.engine.lora keeps LoRA on without adapters: the first one restarts nothing either.
    kept_on = objects(llmd([], engine={"lora": {}}))
    assert kept_on["Deployment"]["spec"]["template"] == objects(llmd([SQL], engine={
        "lora": {}}))["Deployment"]["spec"]["template"]  # fmt: skip
    assert json.loads(kept_on["ConfigMap"]["data"]["loraModules"]) == []


def test_a_starting_engine_serves_only_adapters_it_can_start_with() -> None:
    """Not an adapter the loader has not delivered yet (the folder is not there), nor one an
    engine refused at that path (the pod would crash-loop); one delivered before stays."""
    loaded = {"name": "sql", "path": f"/adapters/{adapter_folder(SQL)}", "state": "Loaded"}
    refused = {"name": "baked", "path": "/opt/adapters/baked", "state": "Failed"}
    obj = {**llmd([SQL, CHAT, BAKED]), "status": {"adapters": [loaded, refused]}}
    assert [m.split("=")[0] for m in lora_modules(obj)] == ["sql", "chat.v2"]
    assert [m.split("=")[0] for m in lora_modules(obj, model_cached=False)] == ["sql"]
    pending = {"name": "sql", "path": loaded["path"], "state": "Pending"}
    assert lora_modules({**obj, "status": {"adapters": [pending]}}, model_cached=False) == [
        "baked=/opt/adapters/baked"]  # fmt: skip
    # A new source of a refused adapter is tried again; a new version waits for the loader.
    moved = {**BAKED, "uri": "/opt/adapters/baked-2"}
    obj = {**llmd([{**SQL, "uri": "hf://acme/qwen-sql-lora@v2"}, moved]),
           "status": {"adapters": [loaded, refused]}}  # fmt: skip
    assert lora_modules(obj, model_cached=False) == ["baked=/opt/adapters/baked-2"]


def test_no_adapters_no_lora_flags_and_no_cache_for_them() -> None:
    args = serve_args(with_defaults(llmd([], source=None)["spec"]))
    assert not any("lora" in arg for arg in args)
    assert "Job" not in objects(llmd([], source=None))


def test_a_changed_uri_is_a_new_folder() -> None:
    moved = {**SQL, "uri": "hf://acme/qwen-sql-lora@v2"}
    assert adapter_folder(moved) != adapter_folder(SQL)
    assert adapter_folder(dict(SQL)) == adapter_folder(SQL)  # stable across reconciles
    assert lora_modules(llmd([SQL])) != lora_modules(llmd([moved]))


# --- delivery: the loader Job and the engine's mounts ----------------------------------------


def test_each_downloaded_adapter_is_an_init_container_of_the_loader() -> None:
    job = objects(llmd([SQL, BAKED, CHAT]))["Job"]
    pod = job["spec"]["template"]["spec"]
    loaders = pod["initContainers"]
    assert [container["name"] for container in loaders] == ["adapter-0", "adapter-1"]
    sql, chat = loaders
    assert sql["command"] == ["pagoda"]
    assert sql["args"][:3] == ["download", SQL["uri"], f"/cache/adapters/{adapter_folder(SQL)}"]
    assert sql["envFrom"] == [{"secretRef": {"name": "hf"}}]
    assert {"name": "PAGODA_ADAPTER", "value": "sql"} in sql["env"]
    assert flag(chat["args"], "--endpoint-url") == "http://minio:9000"
    assert flag(sql["args"], "--lora-max-rank") == "16"  # checked before any engine rolls
    assert "envFrom" not in chat
    assert pod["containers"][0]["args"][1:3] == ["download", HF_MODEL["uri"]]  # the model's
    # A bad adapter URI or token fails the Job at once, whichever container hit it.
    rule = job["spec"]["podFailurePolicy"]["rules"][0]
    assert rule["action"] == "FailJob" and "containerName" not in rule["onExitCodes"]


def test_a_lower_rank_limit_checks_the_adapters_again() -> None:
    job = objects(llmd([SQL], engine={"lora": {"maxLoraRank": 8}}))["Job"]
    (loader,) = job["spec"]["template"]["spec"]["initContainers"]
    assert flag(loader["args"], "--lora-max-rank") == "8"
    assert job_hash(llmd([SQL], engine={"lora": {"maxLoraRank": 8}})) != job_hash(llmd([SQL]))


def test_without_adapters_the_loader_job_is_unchanged() -> None:
    """Deployments made before spec.adapters existed keep their Job (no re-download)."""
    job = objects(llmd([]))["Job"]
    assert "initContainers" not in job["spec"]["template"]["spec"]
    assert job["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]["containerName"] == "loader"
    assert all(m["mountPath"] != "/adapters" for m in engine(llmd([]))["volumeMounts"])


def test_the_engine_mounts_the_adapters_from_the_model_cache() -> None:
    mounts = {m["mountPath"]: m for m in engine(llmd([SQL]))["volumeMounts"]}
    assert mounts["/adapters"] == {
        "name": "model", "mountPath": "/adapters", "subPath": "adapters", "readOnly": True}


def test_adapters_of_a_model_in_the_image_get_a_cache_of_their_own() -> None:
    obj = llmd([SQL], source=None)
    owned = objects(obj)
    assert {"PersistentVolumeClaim", "Job"} <= set(owned)
    pod = owned["Job"]["spec"]["template"]["spec"]
    assert "download" not in pod["containers"][0]["args"]  # no model to fetch
    engine_pod = owned["Deployment"]["spec"]["template"]["spec"]
    volume = next(v for v in engine_pod["volumes"] if v["name"] == "adapter-cache")
    assert volume["persistentVolumeClaim"] == {"claimName": "qwen-model-cache", "readOnly": True}
    mount = next(m for m in engine_pod["containers"][0]["volumeMounts"] if m["name"] == "adapter-cache")
    assert (mount["mountPath"], mount["subPath"], mount["readOnly"]) == (
        "/adapters", "adapters", True)  # fmt: skip
    assert engine_pod["containers"][0]["args"][1] == "default"  # the model stays the image's


def test_adapters_of_a_model_on_a_pvc_mount_the_cache_claim_too() -> None:
    """The model's volume is its own claim: the adapters' mount names a volume that exists."""
    engine_pod = objects(llmd([SQL], source={"pvc": {"claimName": "weights"}}))[
        "Deployment"]["spec"]["template"]["spec"]  # fmt: skip
    volumes = {v["name"]: v for v in engine_pod["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "weights"
    assert volumes["adapter-cache"]["persistentVolumeClaim"]["claimName"] == "qwen-model-cache"
    mount = next(m for m in engine_pod["containers"][0]["volumeMounts"]
                 if m["mountPath"] == "/adapters")  # fmt: skip
    assert mount["name"] == "adapter-cache"


def test_only_local_adapters_need_no_cache() -> None:
    owned = objects(llmd([BAKED], source=None))
    assert "Job" not in owned and "PersistentVolumeClaim" not in owned


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_adapter_objects_validate_for_kubernetes(version: str) -> None:
    for source in (HF_MODEL, None):
        for obj in desired_objects(llmd([SQL, CHAT, BAKED], source), service_monitor_api=False):
            kubernetes_validate.validate(obj, version, strict=True)


# --- the cache's state: a failed adapter is a condition naming it -------------------------------


def job_with(obj: dict[str, Any], *conditions: tuple[str, str], **status: Any) -> dict[str, Any]:
    job = objects(obj)["Job"]
    job["status"] = {
        **status,
        "conditions": [{"type": t, "status": "True", "reason": r} for t, r in conditions],
    }
    return job


def job_hash(obj: dict[str, Any]) -> str:
    return objects(obj)["Job"]["metadata"]["annotations"][c.ANNOTATION_CONFIG_HASH]


def loader_pod(phase: str, init: list[dict[str, Any]], main: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"creationTimestamp": NOW},
        "status": {"phase": phase, "initContainerStatuses": init,
                   "containerStatuses": [{"name": "loader", "state": main}]},
    }  # fmt: skip


def terminated(name: str, code: int, result: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "state": {"terminated": {"exitCode": code,
                                                    "message": json.dumps(result)}}}


def test_a_failed_adapter_download_degrades_naming_the_adapter() -> None:
    obj = llmd([SQL, CHAT])
    failure = {"error": "NotFound", "message": "hf://acme/qwen-sql-lora: no such repository"}
    pods = [loader_pod("Failed", [terminated("adapter-0", 4, failure)],
                       {"waiting": {"reason": "PodInitializing"}})]  # fmt: skip
    state = cache_state(job_with(obj, ("Failed", "PodFailurePolicy")), pods, job_hash(obj))
    assert state.failed and state.reason == "NotFound"
    assert state.message == f"adapter sql: {failure['message']}"
    status = workload_status(obj, objects(obj, model_cached=False)["Deployment"], NOW, cache=state)
    conditions = {cond["type"]: cond for cond in status["conditions"]}
    assert status["phase"] == "Degraded"
    assert conditions["Degraded"]["reason"] == "NotFound"
    assert "adapter sql" in conditions["Degraded"]["message"]
    assert conditions["ModelCached"]["status"] == "False"


def test_a_missing_adapter_secret_shows_while_the_job_waits() -> None:
    obj = llmd([SQL])
    waiting = {"waiting": {"reason": "CreateContainerConfigError",
                           "message": 'secret "hf" not found'}}  # fmt: skip
    pods = [loader_pod("Pending", [{"name": "adapter-0", "state": waiting}],
                       {"waiting": {"reason": "PodInitializing"}})]  # fmt: skip
    state = cache_state(job_with(obj, active=1), pods, job_hash(obj))
    assert state.reason == "CreateContainerConfigError"
    assert state.message == 'adapter sql: secret "hf" not found'


def test_adapters_only_cache_reports_no_model_cache_record() -> None:
    obj = llmd([SQL], source=None)
    pods = [loader_pod("Succeeded", [terminated("adapter-0", 0, {"bytes": 10})],
                       {"terminated": {"exitCode": 0}})]  # fmt: skip
    state = cache_state(job_with(obj, ("Complete", ""), succeeded=1), pods, job_hash(obj))
    assert state.ready and state.message == "1 adapter(s) cached"
    status = workload_status(obj, None, NOW, cache=state)
    assert status["modelCache"] is None
    cached = next(cond for cond in status["conditions"] if cond["type"] == "ModelCached")
    assert cached["status"] == "True"


def test_adding_an_adapter_holds_the_serving_deployment_until_cached() -> None:
    """A new adapter replaces the Job; the reconciler holds the Deployment's update (the
    new --lora-modules) until the Job has delivered it, as for a new model revision."""
    old, new = llmd([SQL], replicas=2), llmd([SQL, CHAT], replicas=2)
    assert job_hash(old) != job_hash(new)
    existing = {(o["apiVersion"], o["kind"], o["metadata"]["name"]): o for o in objects(old).values()}
    actions = plan_actions(
        desired_objects(new, service_monitor_api=False, model_cached=False), existing, "uid-1"
    )
    verbs = {action.kind: action.verb for action in actions}
    assert verbs["Job"] == "replace" and verbs["Deployment"] == "update"


# --- what the operator refuses ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("adapters", "engine", "expected"),
    [
        ([{"name": "acme/sql", "uri": "hf://a/b"}], {}, "spec.adapters[0].name: letters"),
        ([{"name": "a=b", "uri": "hf://a/b"}], {}, "spec.adapters[0].name: letters"),
        ([SQL, SQL], {}, "spec.adapters[1].name: 'sql' is given twice"),
        ([{"name": "Qwen2.5", "uri": "gs://a/b"}], {}, "spec.adapters[0].uri: must be"),
        ([{"name": "x", "uri": "relative/dir"}], {}, "spec.adapters[0].uri: must be"),
        ([{**BAKED, "endpoint": "http://x"}], {}, "spec.adapters[0]: endpoint and credentials"),
        ([SQL], {"lora": {"maxLoras": 4, "maxCpuLoras": 2}}, "maxCpuLoras must be >= maxLoras"),
        ([SQL], {"lora": {"maxLoraRank": 1024}}, "spec.engine.lora.maxLoraRank: must be in"),
        ([SQL], {"extraArgs": ["--max-loras=4"]}, "--max-loras is set by the operator from"),
        ([SQL], {"speculative": {"method": "ngram", "numSpeculativeTokens": 4}},
         "speculative decoding does not run with adapters"),
    ],
)
def test_operator_refuses_bad_adapters(
    adapters: list[dict[str, Any]], engine: dict[str, Any], expected: str
) -> None:
    errors = validate_spec(with_defaults(llmd(adapters, engine=engine)["spec"]))
    assert any(expected in error for error in errors), errors


def test_an_adapter_named_as_the_served_model_is_refused(crd: dict[str, Any]) -> None:
    obj = llmd([{"name": "qwen", "uri": "hf://a/b"}])
    obj["spec"]["model"]["servedModelName"] = "qwen"
    assert any("'qwen' is the served model name" in e for e in validate_spec(
        with_defaults(obj["spec"])))  # fmt: skip
    assert any("must differ from the served model name" in e
               for e in validation_errors(crd, obj))  # fmt: skip


def test_extra_lora_flags_stay_allowed_without_adapters() -> None:
    """Deployments that enabled LoRA through extraArgs before spec.adapters keep working."""
    spec = llmd([], engine={"extraArgs": ["--enable-lora", "--max-loras", "2"]})["spec"]
    assert validate_spec(with_defaults(spec)) == []


def test_the_crd_accepts_the_adapter_forms(crd: dict[str, Any]) -> None:
    obj = llmd([SQL, CHAT, BAKED], engine={"lora": {"maxLoras": 2, "maxLoraRank": 32}})
    assert validation_errors(crd, obj) == []
