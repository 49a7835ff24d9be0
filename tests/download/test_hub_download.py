"""`pagoda download hf://...` against a local server speaking the hub's protocol, through the
real huggingface_hub client (pointed at it with HF_ENDPOINT)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from inference.download import download
from inference.download.common import AuthError, NotFoundError, read_manifest

from .hub_server import HubServer, add_commit

REPO_ROOT = Path(__file__).resolve().parents[2]
REPO = "acme/tiny-model"
COMMIT_V1 = "a" * 40
COMMIT_V2 = "b" * 40
TOKEN = "hf_valid_token"
WEIGHTS = os.urandom(3 * 1024 * 1024 + 17)  # several chunks of huggingface_hub's reads
CONFIG = json.dumps({"architectures": ["LlamaForCausalLM"]}).encode()


@pytest.fixture()
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    root = tmp_path / "hub"
    add_commit(
        root, REPO, COMMIT_V1, {"config.json": CONFIG, "model.safetensors": WEIGHTS}, ("v1",)
    )
    add_commit(
        root,
        REPO,
        COMMIT_V2,
        {"config.json": CONFIG + b" ", "model.safetensors": WEIGHTS[::-1]},
        ("main",),
    )
    add_commit(root, "acme/private-model", COMMIT_V1, {"config.json": CONFIG}, ("main",))
    (root / "acme/private-model/private").touch()
    with HubServer(root, tokens={TOKEN}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        yield server


def downloads_of(hub: HubServer, name: str) -> int:
    return sum(1 for r in hub.state.requests if r.method == "GET" and r.path.endswith("/" + name))


def test_main_branch_download_is_verified_and_recorded(hub: HubServer, tmp_path: Path) -> None:
    dest = tmp_path / "model"
    manifest = download(f"hf://{REPO}", dest)
    assert (dest / "model.safetensors").read_bytes() == WEIGHTS[::-1]
    assert manifest.revision == COMMIT_V2
    assert manifest.num_bytes == len(WEIGHTS) + len(CONFIG) + 1
    assert manifest.files["model.safetensors"].sha256
    assert read_manifest(dest) == manifest

    # A second run finds everything in place: no file is fetched again.
    before = len(hub.state.requests)
    assert download(f"hf://{REPO}", dest) == manifest
    assert not [r for r in hub.state.requests[before:] if "/resolve/" in r.path]


@pytest.mark.parametrize(("revision", "commit"), [("v1", COMMIT_V1), (COMMIT_V1, COMMIT_V1)])
def test_revision_pinning(hub: HubServer, tmp_path: Path, revision: str, commit: str) -> None:
    manifest = download(f"hf://{REPO}@{revision}", tmp_path / "model")
    assert manifest.revision == commit
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == WEIGHTS
    files = [r.path for r in hub.state.requests if "/resolve/" in r.path]
    assert files and all(f"/resolve/{commit}/" in path for path in files)


def test_wrong_token_is_an_auth_failure(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(AuthError, match="refused the credentials.*HF_TOKEN"):
        download(f"hf://{REPO}", tmp_path / "model")


def test_private_repository_needs_the_token(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(NotFoundError, match="private.*HF_TOKEN unset"):
        download("hf://acme/private-model", tmp_path / "no-token")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    manifest = download("hf://acme/private-model", tmp_path / "model")
    assert manifest.files.keys() == {"config.json"}
    assert {r.authorization for r in hub.state.requests[-3:]} == {f"Bearer {TOKEN}"}


@pytest.mark.parametrize(
    ("uri", "message"),
    [("hf://acme/missing", "repository not found"), (f"hf://{REPO}@v9", "revision 'v9'")],
)
def test_missing_repository_or_revision(
    hub: HubServer, tmp_path: Path, uri: str, message: str
) -> None:
    with pytest.raises(NotFoundError, match=message):
        download(uri, tmp_path / "model")


def run_cli(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "inference.cli", "download", *args],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **env},
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_killed_download_resumes_without_refetching_finished_files(
    hub: HubServer, tmp_path: Path
) -> None:
    dest = tmp_path / "model"
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home")}
    hub.state.stall_after["model.safetensors"] = 1024 * 1024
    process = run_cli(f"hf://{REPO}", str(dest), env=env)
    try:
        deadline = time.monotonic() + 120
        while downloads_of(hub, "model.safetensors") == 0 or downloads_of(hub, "config.json") == 0:
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            assert time.monotonic() < deadline, "the download never reached the weights"
            time.sleep(0.1)
        # Finished for huggingface_hub means moved into place *and* recorded: it writes the
        # file's metadata (commit, etag, time: three lines) after the move, and a file
        # without it is fetched again. Killing between the two is a refetch, not a bug.
        metadata = dest / ".cache" / "huggingface" / "download" / "config.json.metadata"
        while not (metadata.is_file() and metadata.read_text().count("\n") >= 3):
            assert time.monotonic() < deadline, "config.json never finished"
            time.sleep(0.1)
    finally:
        process.kill()
        process.wait(timeout=30)
    assert read_manifest(dest) is None  # not a finished download
    assert not (dest / "model.safetensors").exists()

    result = tmp_path / "result.json"
    resumed = run_cli(f"hf://{REPO}", str(dest), "--result-file", str(result), env=env)
    output, _ = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, output
    assert (dest / "model.safetensors").read_bytes() == WEIGHTS[::-1]
    assert downloads_of(hub, "config.json") == 1  # finished before the kill: kept
    assert json.loads(result.read_text())["revision"] == COMMIT_V2
    assert not list(dest.rglob("*.incomplete"))


def test_cli_exit_codes_tell_failures_apart(hub: HubServer, tmp_path: Path) -> None:
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home")}
    result = tmp_path / "result.json"
    wrong_token = run_cli(
        f"hf://{REPO}", str(tmp_path / "a"), "--result-file", str(result),
        env={**env, "HF_TOKEN": "hf_wrong"},
    )  # fmt: skip
    output, _ = wrong_token.communicate(timeout=120)
    assert wrong_token.returncode == 3, output
    assert json.loads(result.read_text())["error"] == "AuthFailed"
    assert "Traceback" not in output

    missing = run_cli("hf://acme/missing", str(tmp_path / "b"), env=env)
    assert missing.wait(timeout=120) == 4
    unreachable = run_cli(
        f"hf://{REPO}", str(tmp_path / "c"), env={**env, "HF_ENDPOINT": "http://127.0.0.1:9"}
    )
    assert unreachable.wait(timeout=120) == 5
