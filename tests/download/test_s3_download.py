"""`pagoda download s3://...` through the real boto3 client against moto's S3 server (with
authentication on), reached through a proxy that can cut a transfer short."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from inference.download import download
from inference.download.common import AuthError, NotFoundError, read_manifest, state_dir

from .s3_server import REGION, S3Server

REPO_ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = os.urandom(4 * 1024 * 1024 + 3)
OBJECTS = {
    "models": {
        "qwen/config.json": b'{"architectures": ["Qwen2ForCausalLM"]}',
        "qwen/model.safetensors": WEIGHTS,
        "qwen/sub/tokenizer.json": b"{}",
        "qwen-other/config.json": b"{}",  # shares the prefix string, not the folder
    }
}


@pytest.fixture(scope="module")
def s3() -> Iterator[tuple[S3Server, dict[str, str]]]:
    with S3Server() as server:
        key_id, secret = server.setup(OBJECTS)
        env = {
            "AWS_ACCESS_KEY_ID": key_id,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_DEFAULT_REGION": REGION,
        }
        yield server, env


@pytest.fixture()
def credentials(s3: tuple[S3Server, dict[str, str]], monkeypatch: pytest.MonkeyPatch) -> S3Server:
    server, env = s3
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return server


def test_prefix_is_downloaded_and_verified(credentials: S3Server, tmp_path: Path) -> None:
    dest = tmp_path / "model"
    manifest = download("s3://models/qwen", dest, endpoint_url=credentials.url)
    assert sorted(manifest.files) == ["config.json", "model.safetensors", "sub/tokenizer.json"]
    assert (dest / "model.safetensors").read_bytes() == WEIGHTS
    entry = manifest.files["model.safetensors"]
    assert entry.etag == hashlib.md5(WEIGHTS).hexdigest()  # single part: the ETag is the MD5
    assert manifest.revision and manifest.revision.startswith("etags-")
    assert read_manifest(dest) == manifest

    # A second run lists the prefix again and fetches nothing.
    gets_before = len(credentials.proxy_state.ranges)
    download("s3://models/qwen", dest, endpoint_url=credentials.url)
    assert [path for path, _ in credentials.proxy_state.ranges[gets_before:]] == ["/models"]


def test_endpoint_from_the_environment(
    credentials: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", credentials.url)
    manifest = download("s3://models/qwen/sub", tmp_path / "model")
    assert list(manifest.files) == ["tokenizer.json"]


def test_wrong_secret_is_an_auth_failure(
    credentials: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(AuthError, match="SignatureDoesNotMatch"):
        download("s3://models/qwen", tmp_path / "model", endpoint_url=credentials.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWN000000000")
    with pytest.raises(AuthError, match="InvalidAccessKeyId|access refused"):
        download("s3://models/qwen", tmp_path / "model", endpoint_url=credentials.url)


@pytest.mark.parametrize(
    ("uri", "message"),
    [("s3://no-such-bucket/x", "NoSuchBucket"), ("s3://models/nothing", "no objects")],
)
def test_missing_bucket_or_prefix(
    credentials: S3Server, tmp_path: Path, uri: str, message: str
) -> None:
    with pytest.raises(NotFoundError, match=message):
        download(uri, tmp_path / "model", endpoint_url=credentials.url)


def test_killed_download_resumes_at_the_byte(
    s3: tuple[S3Server, dict[str, str]], tmp_path: Path
) -> None:
    server, credentials_env = s3
    dest = tmp_path / "model"
    cut = 2 * 1024 * 1024 + 5  # the proxy sends this much of the weights, then stalls
    server.proxy_state.stall_after["/models/qwen/model.safetensors"] = cut
    env = {**os.environ, **credentials_env, "PYTHONPATH": str(REPO_ROOT)}
    command = [
        sys.executable, "-m", "inference.cli", "download", "s3://models/qwen", str(dest),
        "--endpoint-url", server.url, "--result-file", str(tmp_path / "result.json"),
    ]  # fmt: skip
    process = subprocess.Popen(
        command, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    partial_dir = state_dir(dest) / "partial"
    try:
        deadline = time.monotonic() + 120
        while not [p for p in partial_dir.glob("*") if p.stat().st_size >= 1024 * 1024]:
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            assert time.monotonic() < deadline, "the download never reached the cut"
            time.sleep(0.1)
    finally:
        process.kill()
        process.wait(timeout=30)
    assert read_manifest(dest) is None
    (partial,) = partial_dir.glob("*")
    kept = partial.stat().st_size

    resumed = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert (dest / "model.safetensors").read_bytes() == WEIGHTS
    weights_gets = [
        r for path, r in server.proxy_state.ranges if path.endswith("model.safetensors")
    ]
    assert weights_gets[-1] == f"bytes={kept}-"
    assert json.loads((tmp_path / "result.json").read_text())["bytes"] == sum(
        len(v) for k, v in OBJECTS["models"].items() if k.startswith("qwen/")
    )
    assert "resuming qwen/model.safetensors at byte" in resumed.stderr
    assert not list(partial_dir.glob("*"))


def test_cli_exit_code_for_wrong_credentials(
    s3: tuple[S3Server, dict[str, str]], tmp_path: Path
) -> None:
    server, credentials_env = s3
    env = {**os.environ, **credentials_env, "AWS_SECRET_ACCESS_KEY": "wrong"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    result = subprocess.run(
        [sys.executable, "-m", "inference.cli", "download", "s3://models/qwen",
         str(tmp_path / "m"), "--endpoint-url", server.url],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 3, result.stderr
    assert "access refused" in result.stderr and "Traceback" not in result.stderr
