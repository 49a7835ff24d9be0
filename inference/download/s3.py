"""``s3://bucket/prefix``: every object under the prefix, through boto3.

Resumable at the byte: an object is fetched into ``.pagoda/partial/`` under a name that
carries its ETag, and a later run continues it with a ranged GET conditional on the same ETag
(an object changed in between starts over). Each file is checked against the object's size
and, for single-part uploads (whose ETag is the MD5 of the content), its MD5; complete files
whose size and ETag match the previous run's record are not fetched again.

Credentials are boto3's usual chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/
``AWS_SESSION_TOKEN``, profiles, instance roles); ``endpoint_url`` (or ``AWS_ENDPOINT_URL_S3``
/ ``AWS_ENDPOINT_URL``) points at an S3-compatible store such as MinIO or Ceph.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import quote

from inference.download.common import (
    AuthError,
    DownloadError,
    FileEntry,
    IntegrityError,
    Manifest,
    NetworkError,
    NotFoundError,
    Source,
    check_size,
    logger,
    manifest_is_current,
    progress_class,
    read_journal,
    read_manifest,
    record_in_journal,
    remove_manifest,
    safe_relative,
    state_dir,
)

CHUNK_BYTES = 1024 * 1024
MD5_ETAG = re.compile(r"^[0-9a-f]{32}$")
AUTH_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "TokenRefreshRequired",
    "AllAccessDisabled",
    "403",
    "401",
}
NOT_FOUND_CODES = {"NoSuchBucket", "NoSuchKey", "404", "NotFound"}


def s3_client(endpoint_url: str | None) -> Any:
    import boto3
    from botocore.config import Config

    endpoint_url = (
        endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    )
    config = Config(
        retries={"max_attempts": 5, "mode": "standard"},
        connect_timeout=10,
        read_timeout=60,
        # S3-compatible stores rarely serve virtual-host-style bucket names.
        s3={"addressing_style": "path" if endpoint_url else "auto"},
    )
    # A session of its own: boto3's default session keeps the first credentials it found.
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)


def download_s3(source: Source, dest: Path, *, endpoint_url: str | None) -> Manifest:
    client = s3_client(endpoint_url)
    with translated_errors(source):
        objects = list_objects(client, source)
    if not objects:
        raise NotFoundError(f"{source.uri}: no objects under this prefix")
    previous = read_manifest(dest)
    revision = listing_revision(objects)
    if manifest_is_current(dest, previous, source.uri, revision):
        return previous
    remove_manifest(dest)  # the folder is about to change: not a finished download meanwhile
    journal = read_journal(dest)
    total = sum(size for _, size, _ in objects)
    manifest = Manifest(source.uri, revision)
    with progress_class()(total=total, unit="B", unit_scale=True, desc=source.uri) as bar:
        for key, size, etag in objects:
            relative = safe_relative(source.path, key)
            target = dest / relative
            known = journal.get(relative)
            entry = FileEntry(size=size, etag=etag)
            if known == entry and target.is_file() and target.stat().st_size == size:
                bar.update(size)
            else:
                with translated_errors(source):
                    fetch_object(client, source.location, key, etag, size, dest, relative, bar)
                record_in_journal(dest, journal, relative, entry)
            manifest.files[relative] = entry
    return manifest


def list_objects(client: Any, source: Source) -> list[tuple[str, int, str]]:
    """(key, size, ETag) of every object under the prefix, folder markers left out."""
    prefix = source.path.rstrip("/") + "/" if source.path else ""
    result = []
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=source.location, Prefix=prefix):
        for item in page.get("Contents") or []:
            if not item["Key"].endswith("/"):
                result.append((item["Key"], int(item["Size"]), item["ETag"].strip('"')))
    return sorted(result)


def listing_revision(objects: list[tuple[str, int, str]]) -> str:
    """A short digest of keys, sizes and ETags: S3 has no commit, this changes when any does."""
    digest = hashlib.sha256()
    for key, size, etag in objects:
        digest.update(f"{key}\0{size}\0{etag}\n".encode())
    return "etags-" + digest.hexdigest()[:16]


def partial_path(dest: Path, relative: str, etag: str) -> Path:
    # quote() escapes '@', so the name splits back unambiguously.
    return state_dir(dest) / "partial" / f"{quote(relative, safe='')}@{quote(etag, safe='')}"


def fetch_object(
    client: Any, bucket: str, key: str, etag: str, size: int, dest: Path, relative: str, bar: Any
) -> None:
    """Fetches one object into ``dest/relative`` by way of its partial file, resuming that."""
    partial = partial_path(dest, relative, etag)
    partial.parent.mkdir(parents=True, exist_ok=True)
    for stale in partial.parent.glob(partial.name.split("@")[0] + "@*"):
        if stale != partial:
            stale.unlink()  # an earlier version of this object
    have = partial.stat().st_size if partial.exists() else 0
    if have > size:
        partial.unlink()
        have = 0
    bar.update(have)
    md5 = hashlib.md5(usedforsecurity=False)
    if have:
        logger.info("resuming %s at byte %d of %d", key, have, size)
        with open(partial, "rb") as handle:
            while chunk := handle.read(CHUNK_BYTES * 8):
                md5.update(chunk)
    if have < size:
        request: dict[str, Any] = {"Bucket": bucket, "Key": key, "IfMatch": f'"{etag}"'}
        if have:
            request["Range"] = f"bytes={have}-"
        body = client.get_object(**request)["Body"]
        with open(partial, "ab") as handle:
            for chunk in body.iter_chunks(CHUNK_BYTES):
                handle.write(chunk)
                handle.flush()
                md5.update(chunk)
                bar.update(len(chunk))
    try:
        check_size(partial, relative, size)
        if MD5_ETAG.match(etag) and md5.hexdigest() != etag:
            raise IntegrityError(f"{relative}: MD5 {md5.hexdigest()} does not match ETag {etag}")
    except IntegrityError:
        partial.unlink(missing_ok=True)  # the next run starts this file over
        raise
    target = dest / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(partial, target)


class translated_errors:
    """Turns botocore's exceptions into the download's typed failures."""

    def __init__(self, source: Source) -> None:
        self.source = source

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> bool:
        if error is None or isinstance(error, DownloadError):
            return False
        from botocore import exceptions as boto

        uri = self.source.uri
        if isinstance(error, boto.NoCredentialsError | boto.PartialCredentialsError):
            raise AuthError(
                f"{uri}: no S3 credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
            ) from error
        if isinstance(error, boto.ClientError):
            code = str(error.response.get("Error", {}).get("Code", ""))
            message = error.response.get("Error", {}).get("Message") or code
            if code in AUTH_CODES:
                raise AuthError(f"{uri}: access refused ({code}: {message})") from error
            if code in NOT_FOUND_CODES:
                raise NotFoundError(f"{uri}: not found ({code}: {message})") from error
            if code in ("PreconditionFailed", "412"):
                raise NetworkError(
                    f"{uri}: an object changed during the download; retry"
                ) from error
            raise NetworkError(f"{uri}: the store answered {code}: {message}") from error
        if isinstance(error, boto.BotoCoreError):
            raise NetworkError(f"{uri}: {type(error).__name__}: {error}") from error
        return False
