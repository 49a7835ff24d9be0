"""Model delivery for ``hf://`` and ``s3://`` sources: a cache volume filled once by a loader Job.

Weights are downloaded once per LLMDeployment, not once per replica: the operator creates a
PersistentVolumeClaim (``<name>-model-cache``; ReadWriteMany when replicas may run on several
nodes) and a Job (``<name>-model-loader``) that runs ``pagoda download URI DIR`` from the
engine image into a folder of that volume named after the source, so a new revision never
mixes with the old one. Replicas mount the folder read-only once the Job has succeeded; until
then the Deployment is created with no replicas (or, when a previous model is serving, left
as it is). This is KServe's storage-initializer and the shared-PVC pattern of KubeAI and
vLLM production-stack, with the download in a Job of its own so N replicas do not fetch N
copies, and with the outcome in the LLMDeployment's status. The same Job downloads the
hf:// and s3:// LoRA adapters (``adapters``) and speculative draft model (``draft_model``),
one init container each, into folders of their own on the volume.

Credentials come from a Secret named in ``spec.model.source.credentialsSecret`` and reach the
Job's container as environment variables (``HF_TOKEN``; ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``): never through the spec.

The Job's pod failure policy stops at once on the downloader's exit codes for a bad URI (2),
refused credentials (3), a missing repository or bucket (4) and a failed verification (6),
and retries network failures (5) up to its backoff limit: a wrong token is a ``ModelCached``
condition with reason ``AuthFailed``, not a crash loop. The downloader writes its outcome as
JSON to the termination message, where the status reads revision, size or failure from.

Everything here is pure: spec in, objects or a cache state out.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from pagoda_operator import constants as c
from pagoda_operator.adapters import (
    ADAPTER_NAME_ENV,
    ADAPTERS_FOLDER,
    adapter_folder,
    downloaded_adapters,
    max_lora_rank,
)
from pagoda_operator.draft_model import (
    DRAFT_CONTAINER,
    DRAFT_FOLDER,
    DRAFT_MODEL_ENV,
    downloaded_draft,
    draft_folder,
)

DOWNLOAD_SCHEMES = ("hf", "s3")
CACHE_MOUNT_PATH = "/cache"
# Beside the model folders on the cache volume: the engines' compiled kernels (Triton's
# cache), written by the first engine that compiles them and loaded by every later start
# (cold start on the H200: 27-35 s with an empty kernel cache, 12.5-17 s with a filled one).
# The loader creates it, writable by any user, so the engines can write into it.
KERNEL_CACHE_FOLDER = ".kernel-cache"
CACHE_VOLUME = "model-cache"
LOADER_CONTAINER = "loader"
DEFAULT_CACHE_SIZE = "100Gi"
DEFAULT_DOWNLOAD_TIMEOUT_SECONDS = 6 * 3600
LOADER_BACKOFF_LIMIT = 4
# `pagoda download` exit codes that no retry can fix (see inference/download/common.py).
PERMANENT_EXIT_CODES = (2, 3, 4, 6)
LOADER_JOB_LABEL = "batch.kubernetes.io/job-name"
# Pod states that keep a loader from starting and that a user can fix (a missing Secret, a
# wrong image): reported while the Job waits, since the Job itself cannot see them.
BLOCKING_WAIT_REASONS = (
    "CreateContainerConfigError",
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
)


def cache_claim_name(name: str) -> str:
    return f"{name}-model-cache"


def loader_job_name(name: str) -> str:
    return f"{name}-model-loader"


def download_uri(spec: dict[str, Any]) -> str | None:
    """The hf:// or s3:// URI the weights are downloaded from, or None for other sources."""
    uri = ((spec.get("model") or {}).get("source") or {}).get("uri") or ""
    return uri if uri.split("://", 1)[0] in DOWNLOAD_SCHEMES else None


def needs_cache(spec: dict[str, Any]) -> bool:
    """Whether the loader Job and its cache volume exist: for the model's download source,
    for any hf:// or s3:// adapter (spec.adapters), or for an hf:// or s3:// draft model."""
    return bool(download_uri(spec) or downloaded_adapters(spec) or downloaded_draft(spec))


def cache_folder(spec: dict[str, Any]) -> str:
    """The folder of the cache volume that holds this source: readable, unique per source."""
    source = (spec.get("model") or {}).get("source") or {}
    uri = source["uri"]
    identity = json.dumps([uri, source.get("endpoint")])
    digest = hashlib.sha256(identity.encode()).hexdigest()[:10]
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", uri.split("://", 1)[1]).strip("_.")[:80]
    return f"{readable}-{digest}"


def cache_access_mode(spec: dict[str, Any], max_replicas: int) -> str:
    """ReadWriteMany when replicas may land on several nodes, unless the spec says otherwise."""
    cache = (spec.get("model") or {}).get("cache") or {}
    if cache.get("accessMode"):
        return str(cache["accessMode"])
    return "ReadWriteMany" if max_replicas > 1 else "ReadWriteOnce"


def cache_claim_body(spec: dict[str, Any], max_replicas: int) -> dict[str, Any]:
    cache = (spec.get("model") or {}).get("cache") or {}
    claim: dict[str, Any] = {
        "accessModes": [cache_access_mode(spec, max_replicas)],
        "resources": {"requests": {"storage": str(cache.get("size") or DEFAULT_CACHE_SIZE)}},
    }
    if cache.get("storageClassName"):
        claim["storageClassName"] = cache["storageClassName"]
    return {"spec": claim}


def loader_job_body(
    name: str,
    spec: dict[str, Any],
    image: str,
    pod_security: dict[str, Any],
    container_security: dict[str, Any],
) -> dict[str, Any]:
    source = (spec["model"].get("source") or {}) if download_uri(spec) else {}
    cache = spec["model"].get("cache") or {}
    container = _loader_container(LOADER_CONTAINER, spec, image, container_security, source)
    kernel_cache = f"{CACHE_MOUNT_PATH}/{KERNEL_CACHE_FOLDER}"
    if source:
        dest = f"{CACHE_MOUNT_PATH}/{cache_folder(spec)}"
        # `sh -c` only to create the kernel cache first; the arguments pass through as "$@".
        container["command"] = ["/bin/sh", "-c", 'mkdir -p -m 1777 "$0" && exec pagoda "$@"']
        container["args"] = [kernel_cache, *_download_args(source, dest)]
    else:
        # Adapters or a draft only: the Job's one container has nothing left to fetch.
        container["command"] = ["/bin/sh", "-c", 'mkdir -p -m 1777 "$0"']
        container["args"] = [kernel_cache]
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "securityContext": pod_security,
        "containers": [container],
        "volumes": [
            {"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": cache_claim_name(name)}},
            {"name": "tmp", "emptyDir": {}},
        ],
    }
    fetches = [*adapter_loader_containers(spec, image, container_security),
               *draft_loader_containers(spec, image, container_security)]  # fmt: skip
    if fetches:
        # One after the other, before the model's: init containers request the most any
        # one of them does, not the sum, and each leaves its own termination message.
        pod["initContainers"] = fetches
    # The loader is the claim's first consumer: a ReadWriteOnce volume is provisioned in its
    # zone, so it must land where the engines may run (else "volume node affinity conflict").
    for field in ("imagePullSecrets", "nodeSelector", "tolerations", "affinity"):
        if spec.get(field):
            pod[field] = spec[field]
    exit_codes: dict[str, Any] = {"operator": "In", "values": list(PERMANENT_EXIT_CODES)}
    if not fetches:
        exit_codes = {"containerName": LOADER_CONTAINER, **exit_codes}
    return _loader_job(name, cache, pod, exit_codes)


def _download_args(source: dict[str, Any], dest: str) -> list[str]:
    args = ["download", source["uri"], dest, "--result-file", "/dev/termination-log"]
    if source.get("endpoint"):
        args += ["--endpoint-url", source["endpoint"]]
    return args


def adapter_loader_containers(
    spec: dict[str, Any], image: str, container_security: dict[str, Any]
) -> list[dict[str, Any]]:
    """One ``pagoda download --lora-max-rank R`` per hf:// or s3:// adapter, into
    ``adapters/<folder>``."""
    containers = []
    for index, adapter in enumerate(downloaded_adapters(spec)):
        container = _loader_container(
            f"adapter-{index}", spec, image, container_security, adapter
        )
        dest = f"{CACHE_MOUNT_PATH}/{ADAPTERS_FOLDER}/{adapter_folder(adapter)}"
        container["command"] = ["pagoda"]
        # The folder must be an adapter the engines serve (exit 6 otherwise, InvalidAdapter):
        # a bad one fails here, before any engine rolls, not in each engine's start.
        container["args"] = [*_download_args(adapter, dest),
                             "--lora-max-rank", str(max_lora_rank(spec))]  # fmt: skip
        container["env"].append({"name": ADAPTER_NAME_ENV, "value": adapter["name"]})
        containers.append(container)
    return containers


def draft_loader_containers(
    spec: dict[str, Any], image: str, container_security: dict[str, Any]
) -> list[dict[str, Any]]:
    """The hf:// or s3:// draft model's ``pagoda download``, into ``draft/<folder>``; none
    for a draft given as a path."""
    source = downloaded_draft(spec)
    if source is None:
        return []
    container = _loader_container(DRAFT_CONTAINER, spec, image, container_security, source)
    container["command"] = ["pagoda"]
    dest = f"{CACHE_MOUNT_PATH}/{DRAFT_FOLDER}/{draft_folder(source)}"
    container["args"] = _download_args(source, dest)
    container["env"].append({"name": DRAFT_MODEL_ENV, "value": source["uri"]})
    return [container]


def _loader_container(
    container_name: str,
    spec: dict[str, Any],
    image: str,
    container_security: dict[str, Any],
    source: dict[str, Any],
) -> dict[str, Any]:
    """A loader container without its command: image, environment, mounts, credentials."""
    container: dict[str, Any] = {
        "name": container_name,
        "image": image,
        "env": [
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
            {"name": "HF_HOME", "value": "/tmp/huggingface"},
        ],
        "resources": {
            "requests": {"cpu": "500m", "memory": "1Gi"},
            "limits": {"memory": "4Gi"},
        },
        "volumeMounts": [
            {"name": CACHE_VOLUME, "mountPath": CACHE_MOUNT_PATH},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        # The downloader writes its JSON outcome here; a crash leaves the log's tail instead.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security,
    }
    if source.get("credentialsSecret"):
        container["envFrom"] = [{"secretRef": {"name": source["credentialsSecret"]["name"]}}]
    if spec.get("imagePullPolicy"):
        container["imagePullPolicy"] = spec["imagePullPolicy"]
    return container


def _loader_job(
    name: str, cache: dict[str, Any], pod: dict[str, Any], exit_codes: dict[str, Any]
) -> dict[str, Any]:
    return {
        "spec": {
            "backoffLimit": LOADER_BACKOFF_LIMIT,
            "activeDeadlineSeconds": int(
                cache.get("downloadTimeoutSeconds") or DEFAULT_DOWNLOAD_TIMEOUT_SECONDS
            ),
            "podFailurePolicy": {
                "rules": [
                    {
                        "action": "FailJob",
                        # With adapters or a draft, no containerName: any container,
                        # init ones too.
                        "onExitCodes": exit_codes,
                    },
                    # A node drained or a pod preempted is not the loader's failure.
                    {
                        "action": "Ignore",
                        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                    },
                ]
            },
            "template": {
                "metadata": {
                    "labels": {
                        c.LABEL_OWNER: name,
                        c.LABEL_COMPONENT: "model-loader",
                        c.LABEL_MANAGED_BY: c.OPERATOR_NAME,
                    }
                },
                "spec": pod,
            },
        }
    }


# --- the cache's state, from the Job and its pods ---------------------------------------------


@dataclass(frozen=True)
class CacheState:
    """Where the model cache stands. ``ready``: replicas may start; ``failed``: the loader
    gave up and will not try again until the spec changes or its Job is deleted."""

    ready: bool
    failed: bool
    reason: str
    message: str
    revision: str | None = None
    num_bytes: int | None = None
    num_files: int | None = None

    def status(self, spec: dict[str, Any], name: str) -> dict[str, Any] | None:
        """``status.modelCache``; None when only adapters or a draft are downloaded."""
        if not download_uri(spec):
            return None
        result: dict[str, Any] = {
            "uri": spec["model"]["source"]["uri"],
            "claimName": cache_claim_name(name),
            "path": cache_folder(spec),
            "state": "Ready" if self.ready else ("Failed" if self.failed else "Loading"),
        }
        if self.revision is not None:
            result["revision"] = self.revision
        if self.num_bytes is not None:
            result["bytes"] = self.num_bytes
        if self.num_files is not None:
            result["files"] = self.num_files
        return result


def cache_state(
    job: dict[str, Any] | None, pods: list[dict[str, Any]], desired_hash: str | None
) -> CacheState:
    """The cache's state for the loader Job as it exists (None: not created yet) and its pods."""
    if job is None or _stored_hash(job) != desired_hash:
        return CacheState(False, False, "LoaderStarting", "Starting the model loader Job")
    conditions = {
        cond.get("type"): cond for cond in (job.get("status") or {}).get("conditions") or []
    }
    fetches = _fetch_names(job)
    if _is_true(conditions.get("Complete")) or int((job.get("status") or {}).get("succeeded") or 0):
        result = _termination_result(pods, succeeded=True) or {}
        message = f"{result.get('bytes', '?')} bytes at revision {result.get('revision') or '-'}"
        if fetches:
            model = message if _downloads_model(job) else None
            message = "; ".join(filter(None, [model, *_fetches_cached(fetches)]))
        return CacheState(
            True,
            False,
            "Cached",
            message,
            revision=result.get("revision"),
            num_bytes=result.get("bytes"),
            num_files=result.get("files"),
        )
    if _is_true(conditions.get("Failed")):
        result = _termination_result(pods, succeeded=False, fetches=fetches) or {}
        failed = conditions["Failed"]
        reason = str(result.get("error") or failed.get("reason") or "LoaderFailed")
        message = str(result.get("message") or failed.get("message") or "the model loader failed")
        return CacheState(False, True, reason, message)
    for pod in pods:
        for status in _container_statuses(pod):
            waiting = (status.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in BLOCKING_WAIT_REASONS:
                message = _naming(fetches, status, waiting.get("message") or waiting["reason"])
                return CacheState(False, False, waiting["reason"], message)
    failures = int((job.get("status") or {}).get("failed") or 0)
    last = _termination_result(pods, succeeded=False, fetches=fetches) or {}
    message = "Downloading the model"
    if failures:
        message += f" (attempt {failures + 1}; last: {last.get('message') or 'failed'})"
    return CacheState(False, False, "Downloading", message)


def _termination_result(
    pods: list[dict[str, Any]], *, succeeded: bool, fetches: dict[str, str] | None = None
) -> dict[str, Any] | None:
    """The JSON the downloader left in the newest matching pod's termination message: the
    model's on success; on failure the failed container's, its message naming the adapter
    or draft model it fetched."""
    wanted = "Succeeded" if succeeded else "Failed"
    candidates = [pod for pod in pods if (pod.get("status") or {}).get("phase") == wanted]
    candidates.sort(key=lambda pod: (pod.get("metadata") or {}).get("creationTimestamp") or "")
    for pod in reversed(candidates):
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        if not succeeded:
            statuses = [s for s in _container_statuses(pod) if _exit_code(s) != 0]
        for status in statuses:
            terminated = (status.get("state") or {}).get("terminated") or {}
            text = terminated.get("message") or ""
            try:
                result = json.loads(text)
            except ValueError:
                if text:
                    message = _naming(fetches or {}, status, text.strip()[-500:])
                    return {"error": "LoaderFailed", "message": message}
                continue
            if isinstance(result, dict):
                if result.get("message") is not None:
                    result["message"] = _naming(fetches or {}, status, str(result["message"]))
                return result
    return None


def _container_statuses(pod: dict[str, Any]) -> list[dict[str, Any]]:
    status = pod.get("status") or {}
    return [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]


def _exit_code(status: dict[str, Any]) -> int | None:
    return ((status.get("state") or {}).get("terminated") or {}).get("exitCode")


def _fetch_names(job: dict[str, Any]) -> dict[str, str]:
    """Loader container name -> what it downloads besides the model, ``adapter NAME`` or
    ``draft model URI`` (from the Job's template)."""
    pod = (((job.get("spec") or {}).get("template") or {}).get("spec")) or {}
    labels = {ADAPTER_NAME_ENV: "adapter", DRAFT_MODEL_ENV: "draft model"}
    names = {}
    for container in pod.get("initContainers") or []:
        for env in container.get("env") or []:
            if env.get("name") in labels:
                names[container.get("name")] = f"{labels[env['name']]} {env.get('value')}"
    return names


def _fetches_cached(fetches: dict[str, str]) -> list[str]:
    """The success message's words for the adapters and the draft model."""
    adapters = sum(label.startswith("adapter ") for label in fetches.values())
    others = [f"{label} cached" for label in fetches.values() if not label.startswith("adapter ")]
    words = [f"{adapters} adapter(s) cached"] if adapters else []
    return words + others


def _downloads_model(job: dict[str, Any]) -> bool:
    pod = (((job.get("spec") or {}).get("template") or {}).get("spec")) or {}
    return any("download" in (container.get("args") or []) for container in pod.get("containers") or [])


def _naming(fetches: dict[str, str], status: dict[str, Any], message: str) -> str:
    label = fetches.get(status.get("name") or "")
    return f"{label}: {message}" if label else message


def _is_true(cond: dict[str, Any] | None) -> bool:
    return bool(cond) and cond.get("status") == "True"


def _stored_hash(obj: dict[str, Any]) -> str | None:
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(c.ANNOTATION_CONFIG_HASH)
