"""What every download source shares: the URI, typed failures with exit codes, the manifest
that marks a finished download, file verification and progress reporting.

A download is finished only when ``DIR/.pagoda/manifest.json`` exists and names the same
source: it is written last, after every file was verified, so a reader (the operator's loader
Job, a second run) never mistakes a half-filled folder for a model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

from tqdm.auto import tqdm

logger = logging.getLogger("inference.download")

STATE_DIR = ".pagoda"
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
HASH_CHUNK = 8 * 1024 * 1024


# --- failures ---------------------------------------------------------------------------------


class DownloadError(Exception):
    """A download that cannot finish; ``exit_code`` tells a caller (a Job's pod failure policy,
    the operator reading the termination message) which kind of failure it was."""

    exit_code: ClassVar[int] = 1
    kind: ClassVar[str] = "Failed"


class InvalidSourceError(DownloadError):
    exit_code = 2
    kind = "InvalidSource"


class AuthError(DownloadError):
    """Credentials missing, wrong, or without access: retrying does not help."""

    exit_code = 3
    kind = "AuthFailed"


class NotFoundError(DownloadError):
    """The repository, revision, bucket or prefix does not exist: retrying does not help."""

    exit_code = 4
    kind = "NotFound"


class NetworkError(DownloadError):
    """The store could not be reached or answered with a server error: worth retrying."""

    exit_code = 5
    kind = "Unreachable"


class IntegrityError(DownloadError):
    """A file's size or checksum does not match what the store says it should be."""

    exit_code = 6
    kind = "VerificationFailed"


# --- the source URI ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """A parsed source URI: ``hf://org/name[@revision]``, ``s3://bucket/prefix``,
    ``pvc://claim/path`` or a local path (``file:///path`` or a plain path)."""

    uri: str
    scheme: str  # "hf", "s3", "pvc" or "file"
    location: str  # hub repo id, bucket, claim name, or the local path
    path: str = ""  # S3 prefix or the path inside the claim
    revision: str | None = None  # hub branch, tag or commit


def parse_source(uri: str) -> Source:
    """Splits a source URI; InvalidSourceError says what is wrong with a bad one."""
    if "://" not in uri:
        if not uri:
            raise InvalidSourceError("empty source URI")
        return Source(uri, "file", str(Path(uri)))
    scheme = uri.split("://", 1)[0]
    parts = urlsplit(uri)
    rest = (parts.netloc + parts.path).strip("/")
    if scheme == "hf":
        repo, _, revision = rest.partition("@")
        if repo.count("/") != 1 or not all(repo.split("/")):
            raise InvalidSourceError(f"{uri}: expected hf://ORG/NAME[@REVISION]")
        if "@" in rest and not revision:
            raise InvalidSourceError(f"{uri}: empty revision after '@'")
        return Source(uri, "hf", repo, revision=revision or None)
    if scheme == "s3":
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise InvalidSourceError(f"{uri}: expected s3://BUCKET[/PREFIX]")
        return Source(uri, "s3", bucket, prefix)
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        if not claim:
            raise InvalidSourceError(f"{uri}: expected pvc://CLAIM[/PATH]")
        return Source(uri, "pvc", claim, path)
    if scheme == "file":
        if not parts.path:
            raise InvalidSourceError(f"{uri}: expected file:///ABSOLUTE/PATH")
        return Source(uri, "file", parts.path)
    raise InvalidSourceError(f"{uri}: unsupported scheme {scheme!r} (use hf://, s3://, pvc://)")


# --- the manifest -----------------------------------------------------------------------------


@dataclass
class FileEntry:
    size: int
    etag: str | None = None  # the store's version tag (S3 ETag, hub blob or LFS id)
    sha256: str | None = None


@dataclass
class Manifest:
    """What a finished download holds; written last."""

    uri: str
    revision: str | None
    files: dict[str, FileEntry] = field(default_factory=dict)
    version: int = MANIFEST_VERSION

    @property
    def num_bytes(self) -> int:
        return sum(entry.size for entry in self.files.values())

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "bytes": self.num_bytes}


def state_dir(dest: Path) -> Path:
    return dest / STATE_DIR


def read_manifest(dest: Path) -> Manifest | None:
    try:
        data = json.loads((state_dir(dest) / MANIFEST).read_text())
        files = {path: FileEntry(**entry) for path, entry in data["files"].items()}
        if data.get("version") != MANIFEST_VERSION:
            return None
        return Manifest(data["uri"], data.get("revision"), files)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_manifest(dest: Path, manifest: Manifest) -> None:
    write_json_atomic(state_dir(dest) / MANIFEST, manifest.to_json())


JOURNAL = "files.json"


def read_journal(dest: Path) -> dict[str, FileEntry]:
    """Files an earlier (maybe interrupted) run finished, as recorded right after each one."""
    try:
        data = json.loads((state_dir(dest) / JOURNAL).read_text())
        return {path: FileEntry(**entry) for path, entry in data.items()}
    except (OSError, ValueError, TypeError):
        return {}


def record_in_journal(
    dest: Path, journal: dict[str, FileEntry], path: str, entry: FileEntry
) -> None:
    journal[path] = entry
    write_json_atomic(
        state_dir(dest) / JOURNAL, {name: asdict(item) for name, item in journal.items()}
    )


def remove_manifest(dest: Path) -> None:
    (state_dir(dest) / MANIFEST).unlink(missing_ok=True)


def write_json_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(temporary, path)


def manifest_is_current(
    dest: Path, manifest: Manifest | None, uri: str, revision: str | None
) -> bool:
    """The folder already holds this exact source, every file at its recorded size."""
    if manifest is None or manifest.uri != uri or manifest.revision != revision:
        return False
    return all(
        (dest / path).is_file() and (dest / path).stat().st_size == entry.size
        for path, entry in manifest.files.items()
    )


# --- verification -----------------------------------------------------------------------------


def file_digest(path: Path, algorithm: str, start: Any = None) -> str:
    digest = start or hashlib.new(algorithm)
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_size(path: Path, relative: str, expected: int) -> None:
    actual = path.stat().st_size
    if actual != expected:
        raise IntegrityError(f"{relative}: {actual} bytes on disk, the store says {expected}")


def check_digest(path: Path, relative: str, algorithm: str, expected: str) -> None:
    actual = file_digest(path, algorithm)
    if actual != expected.lower():
        raise IntegrityError(
            f"{relative}: {algorithm} {actual} does not match the store's {expected}"
        )


def safe_relative(root: str, key: str) -> str:
    """``key`` below ``root`` as a relative path that cannot climb out of the target."""
    relative = key[len(root) :].lstrip("/") if root else key
    parts = [part for part in relative.split("/") if part not in ("", ".")]
    if not parts or ".." in parts or parts[0] == STATE_DIR:
        raise IntegrityError(f"refusing to write {key!r}: not a plain path below {root!r}")
    return "/".join(parts)


# --- progress ---------------------------------------------------------------------------------

LOG_INTERVAL_SECONDS = 15.0


class _LogLines:
    """A file-like sink that turns tqdm's redraws into log lines (no carriage returns)."""

    def write(self, text: str) -> None:
        line = text.strip("\r\n ")
        if line:
            logger.info("%s", line)

    def flush(self) -> None:
        pass


class LogTqdm(tqdm):
    """tqdm that prints a plain log line at most every LOG_INTERVAL_SECONDS: what a pod's log
    (or any file) should get instead of a redrawn bar."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("name", None)
        kwargs.update(file=_LogLines(), mininterval=LOG_INTERVAL_SECONDS, ascii=True, disable=False)
        kwargs.setdefault("dynamic_ncols", False)
        kwargs["ncols"] = 100
        super().__init__(*args, **kwargs)


def progress_class() -> type[tqdm]:
    """A redrawn bar in a terminal, progress lines in logs."""
    return tqdm if sys.stderr.isatty() else LogTqdm


class Stopwatch:
    def __init__(self) -> None:
        self.start = time.monotonic()

    def rate(self, num_bytes: int) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-6)
        return f"{num_bytes / elapsed / 1e6:.1f} MB/s"
