"""spec.engine.speculative.draftModel: an hf:// or s3:// draft (or EAGLE head) delivered by
the loader Job like the model, and named in the engine's --speculative-config, as pure
functions (spec in, objects, flags, cache state or problems out)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from download.hub_server import HubServer, add_commit
from pagoda_operator import constants as c
from pagoda_operator.desired import desired_objects
from pagoda_operator.draft_model import downloaded_draft, draft_folder
from pagoda_operator.model_cache import cache_state
from pagoda_operator.plan import plan_actions
from pagoda_operator.spec import validate_spec, with_defaults
from pagoda_operator.status import workload_status

from inference.download import add_download_args, run_download

from .crd_schema import validation_errors
from .test_adapters import NOW, flag, job_hash, job_with, loader_pod, terminated
from .test_manifests import KUBERNETES_VERSIONS

HF_MODEL = {"uri": "hf://Qwen/Qwen2.5-7B-Instruct@v1"}
PVC_MODEL = {"pvc": {"claimName": "weights"}}
DRAFT = {"method": "draft_model", "numSpeculativeTokens": 4,
         "draftModel": "hf://Qwen/Qwen2.5-0.5B-Instruct@v2",
         "draftCredentialsSecret": {"name": "hf"}}  # fmt: skip
EAGLE = {"method": "eagle", "numSpeculativeTokens": 3, "draftModel": "s3://heads/eagle-qwen",
         "draftEndpoint": "http://minio:9000"}  # fmt: skip


def llmd(speculative: dict[str, Any] | None, source: dict[str, Any] | None = HF_MODEL,
         **spec: Any) -> dict[str, Any]:  # fmt: skip
    model: dict[str, Any] = {"name": "Qwen/Qwen2.5-7B-Instruct"}
    if source is not None:
        model["source"] = source
    engine = {"speculative": speculative} if speculative is not None else {}
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "metadata": {"name": "qwen", "namespace": "ml", "uid": "uid-1", "generation": 1},
        "spec": {"model": model, "engine": engine, **spec},
    }


def objects(obj: dict[str, Any], **kwargs: Any) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in desired_objects(obj, service_monitor_api=False, **kwargs)}


def engine_pod(obj: dict[str, Any]) -> dict[str, Any]:
    return objects(obj)["Deployment"]["spec"]["template"]["spec"]


def engine_draft(obj: dict[str, Any]) -> str:
    """The draft's path as the engine reads it from --speculative-config."""
    args = engine_pod(obj)["containers"][0]["args"]
    return json.loads(flag(args, "--speculative-config") or "{}")["model"]


def loader_draft(obj: dict[str, Any]) -> dict[str, Any]:
    pod = objects(obj)["Job"]["spec"]["template"]["spec"]
    return next(init for init in pod["initContainers"] if init["name"] == "draft")


def test_the_draft_is_an_init_container_of_the_loader_with_its_credentials() -> None:
    obj = llmd(DRAFT)
    draft = loader_draft(obj)
    folder = draft_folder(downloaded_draft(with_defaults(obj["spec"])) or {})
    assert folder.startswith("Qwen_Qwen2.5-0.5B-Instruct_v2-")
    assert draft["command"] == ["pagoda"]
    assert draft["args"] == ["download", DRAFT["draftModel"], f"/cache/draft/{folder}",
                             "--result-file", "/dev/termination-log"]  # fmt: skip
    assert draft["envFrom"] == [{"secretRef": {"name": "hf"}}]
    assert {"name": "PAGODA_DRAFT_MODEL", "value": DRAFT["draftModel"]} in draft["env"]
    pod = objects(obj)["Job"]["spec"]["template"]["spec"]
    assert "download" in pod["containers"][0]["args"]  # the model still comes after it
    # Any container's permanent exit code fails the Job, the draft's too.
    rules = objects(obj)["Job"]["spec"]["podFailurePolicy"]["rules"]
    assert "containerName" not in rules[0]["onExitCodes"]


def test_an_s3_head_gets_its_endpoint() -> None:
    draft = loader_draft(llmd(EAGLE))
    assert draft["args"][-2:] == ["--endpoint-url", "http://minio:9000"]
    assert "envFrom" not in draft


def test_the_engine_reads_the_draft_from_the_cache_mount() -> None:
    obj = llmd(DRAFT)
    folder = loader_draft(obj)["args"][2].removeprefix("/cache/draft/")
    assert engine_draft(obj) == f"/draft/{folder}"
    mounts = {m["mountPath"]: m for m in engine_pod(obj)["containers"][0]["volumeMounts"]}
    assert mounts["/draft"] == {
        "name": "model", "mountPath": "/draft", "subPath": "draft", "readOnly": True}
    config = json.loads(flag(engine_pod(obj)["containers"][0]["args"], "--speculative-config"))
    assert config == {"method": "draft_model", "num_speculative_tokens": 4,
                      "model": f"/draft/{folder}"}  # fmt: skip


def test_a_draft_of_a_model_on_a_pvc_gets_the_cache_of_its_own() -> None:
    """The model is mounted from its claim; the draft still needs the cache and its loader."""
    owned = objects(llmd(EAGLE, source=PVC_MODEL))
    assert {"PersistentVolumeClaim", "Job"} <= set(owned)
    pod = owned["Job"]["spec"]["template"]["spec"]
    assert "download" not in pod["containers"][0]["args"]  # no model to fetch
    engine = owned["Deployment"]["spec"]["template"]["spec"]
    volume = next(v for v in engine["volumes"] if v["name"] == "draft-cache")
    assert volume["persistentVolumeClaim"] == {"claimName": "qwen-model-cache", "readOnly": True}
    mount = next(m for m in engine["containers"][0]["volumeMounts"] if m["name"] == "draft-cache")
    assert (mount["mountPath"], mount["subPath"], mount["readOnly"]) == ("/draft", "draft", True)
    assert engine["containers"][0]["args"][1] == "/models"  # the model stays the claim's


def test_a_draft_path_needs_no_cache_and_is_passed_as_given() -> None:
    obj = llmd({**DRAFT, "draftModel": "/models/draft", "draftCredentialsSecret": None},
               source=PVC_MODEL)  # fmt: skip
    owned = objects(obj)
    assert "Job" not in owned and "PersistentVolumeClaim" not in owned
    assert engine_draft(obj) == "/models/draft"
    # A downloaded model without a downloaded draft: the loader is as it was.
    assert "initContainers" not in objects(llmd(None))["Job"]["spec"]["template"]["spec"]


def test_a_changed_draft_is_a_new_folder_a_new_job_and_a_rollout() -> None:
    old, new = llmd(DRAFT, replicas=2), llmd({**DRAFT, "draftModel": "hf://Qwen/d@v3"}, replicas=2)
    assert loader_draft(old)["args"][2] != loader_draft(new)["args"][2]
    assert job_hash(old) != job_hash(new)
    existing = {(o["apiVersion"], o["kind"], o["metadata"]["name"]): o
                for o in objects(old).values()}  # fmt: skip
    actions = plan_actions(
        desired_objects(new, service_monitor_api=False, model_cached=False), existing, "uid-1"
    )
    verbs = {action.kind: action.verb for action in actions}
    # The reconciler holds the Deployment's update until the Job has delivered the draft.
    assert verbs["Job"] == "replace" and verbs["Deployment"] == "update"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_draft_objects_validate_for_kubernetes(version: str) -> None:
    for obj in (llmd(DRAFT), llmd(EAGLE, source=PVC_MODEL), llmd(EAGLE, source=None)):
        for rendered in desired_objects(obj, service_monitor_api=False):
            kubernetes_validate.validate(rendered, version, strict=True)


# --- the cache's state: a failed draft is a condition naming it ----------------------------------


def test_a_failed_draft_download_degrades_naming_the_draft() -> None:
    obj = llmd(DRAFT)
    failure = {"error": "AuthFailed", "message": "the token was refused"}
    pods = [loader_pod("Failed", [terminated("draft", 3, failure)],
                       {"waiting": {"reason": "PodInitializing"}})]  # fmt: skip
    state = cache_state(job_with(obj, ("Failed", "PodFailurePolicy")), pods, job_hash(obj))
    assert state.failed and state.reason == "AuthFailed"
    assert state.message == f"draft model {DRAFT['draftModel']}: the token was refused"
    status = workload_status(obj, objects(obj, model_cached=False)["Deployment"], NOW, cache=state)
    conditions = {cond["type"]: cond for cond in status["conditions"]}
    assert status["phase"] == "Degraded"
    assert conditions["Degraded"]["reason"] == "AuthFailed"
    assert DRAFT["draftModel"] in conditions["Degraded"]["message"]
    assert conditions["ModelCached"]["status"] == "False"
    assert objects(obj, model_cached=False)["Deployment"]["spec"]["replicas"] == 0


def test_a_missing_draft_secret_shows_while_the_job_waits() -> None:
    obj = llmd(DRAFT)
    waiting = {"waiting": {"reason": "CreateContainerConfigError",
                           "message": 'secret "hf" not found'}}  # fmt: skip
    pods = [loader_pod("Pending", [{"name": "draft", "state": waiting}],
                       {"waiting": {"reason": "PodInitializing"}})]  # fmt: skip
    state = cache_state(job_with(obj, active=1), pods, job_hash(obj))
    assert state.reason == "CreateContainerConfigError" and not state.failed
    assert state.message == f'draft model {DRAFT["draftModel"]}: secret "hf" not found'


def test_a_cached_draft_is_said() -> None:
    obj = llmd(EAGLE, source=PVC_MODEL)
    pods = [loader_pod("Succeeded", [terminated("draft", 0, {"bytes": 10})],
                       {"terminated": {"exitCode": 0}})]  # fmt: skip
    state = cache_state(job_with(obj, ("Complete", ""), succeeded=1), pods, job_hash(obj))
    assert state.ready and state.message == f"draft model {EAGLE['draftModel']} cached"
    status = workload_status(obj, None, NOW, cache=state)
    assert status["modelCache"] is None  # the model itself is not downloaded
    cached = next(cond for cond in status["conditions"] if cond["type"] == "ModelCached")
    assert cached["status"] == "True"


# --- what the operator and the CRD refuse ------------------------------------------------------


@pytest.mark.parametrize(
    ("speculative", "expected"),
    [
        ({**DRAFT, "draftModel": "gs://bucket/draft"}, "draftModel: must be hf://ORG/NAME"),
        ({**DRAFT, "draftModel": "hf://just-a-name"}, "draftModel: must be hf://ORG/NAME"),
        ({**DRAFT, "draftModel": "s3://B/upper"}, "draftModel: must be hf://ORG/NAME"),
        ({**DRAFT, "draftModel": "models/draft"}, "an absolute path in the engine container"),
        ({**DRAFT, "draftModel": "/models/draft"}, "draftEndpoint and draftCredentialsSecret go"),
        ({"method": "ngram", "numSpeculativeTokens": 4, "draftEndpoint": "http://x"},
         "go with methods draft_model, eagle and eagle3"),
    ],
)
def test_bad_drafts_are_refused(speculative: dict[str, Any], expected: str,
                                crd: dict[str, Any]) -> None:  # fmt: skip
    obj = llmd(speculative)
    errors = validate_spec(with_defaults(obj["spec"]))
    assert any(expected in error for error in errors), errors
    assert validation_errors(crd, obj), "the CRD lets it through"


def test_the_crd_accepts_the_draft_forms(crd: dict[str, Any]) -> None:
    for speculative in (DRAFT, EAGLE, {**EAGLE, "method": "eagle3"},
                        {**DRAFT, "draftModel": "/models/draft",
                         "draftCredentialsSecret": None}):  # fmt: skip
        obj = llmd({k: v for k, v in speculative.items() if v is not None})
        assert validation_errors(crd, obj) == []
        assert validate_spec(with_defaults(obj["spec"])) == []


# --- end to end: the loader's draft container fills the folder the engine flag names ----------


def test_the_draft_lands_where_the_engine_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The draft container's own arguments, run by `pagoda download` against a local hub, with
    the cache volume at a temporary folder: the engine's --speculative-config path, read
    through its /draft mount, is the downloaded draft."""
    hub_root = tmp_path / "hub"
    config = json.dumps({"architectures": ["LlamaForCausalLM"]}).encode()
    add_commit(hub_root, "Qwen/Qwen2.5-0.5B-Instruct", "c" * 40,
               {"config.json": config, "model.safetensors": b"\0" * 4096}, ("v2",))  # fmt: skip
    obj = llmd(DRAFT)
    draft = loader_draft(obj)
    cache = tmp_path / "cache"
    with HubServer(hub_root) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        argv = [str(arg).replace("/cache", str(cache), 1) for arg in draft["args"][1:]]
        argv[argv.index("--result-file") + 1] = str(tmp_path / "result.json")
        assert run_download(add_download_args(argparse.ArgumentParser()).parse_args(argv)) == 0
    assert json.loads((tmp_path / "result.json").read_text())["revision"] == "c" * 40
    mount = next(m for m in engine_pod(obj)["containers"][0]["volumeMounts"]
                 if m["mountPath"] == "/draft")  # fmt: skip
    in_cache = cache / mount["subPath"] / engine_draft(obj).removeprefix("/draft/")
    assert (in_cache / "config.json").read_bytes() == config
