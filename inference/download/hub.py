"""``hf://org/name[@revision]``: a Hugging Face Hub repository, through huggingface_hub.

The revision (branch, tag or commit; ``main`` when left out) is resolved to a commit first,
and everything after that asks for that commit, so a branch that moves during the download
cannot mix two versions. ``snapshot_download`` into the target folder skips files it already
fetched for this commit and refetches a file cut off by an interrupted run; afterwards every
file is checked against the repository's listing: its size, and the SHA-256 of LFS files
(the weights).

The endpoint is ``HF_ENDPOINT`` (a mirror, or a private hub); the token ``HF_TOKEN``.
"""

from __future__ import annotations

import os
from pathlib import Path

from inference.download.common import (
    AuthError,
    FileEntry,
    IntegrityError,
    Manifest,
    NetworkError,
    NotFoundError,
    Source,
    check_digest,
    check_size,
    logger,
    manifest_is_current,
    progress_class,
    read_manifest,
    remove_manifest,
    state_dir,
)

HUB_METADATA_DIR = ".cache"  # where huggingface_hub keeps its local-dir bookkeeping


def download_hub(source: Source, dest: Path, *, endpoint: str | None) -> Manifest:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.hf_api import RepoFile

    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    token = os.environ.get("HF_TOKEN") or None
    api = HfApi(endpoint=endpoint, token=token)
    with translated_errors(source, token):
        commit = api.repo_info(source.location, revision=source.revision or "main").sha
        if not commit:
            raise NetworkError(f"{source.uri}: the hub did not say which commit it serves")
        listing = {
            entry.path: entry
            for entry in api.list_repo_tree(source.location, revision=commit, recursive=True)
            if isinstance(entry, RepoFile)
        }
        logger.info("%s is commit %s: %d files", source.uri, commit, len(listing))
        previous = read_manifest(dest)
        if manifest_is_current(dest, previous, source.uri, commit):
            return previous
        remove_manifest(dest)
        snapshot_download(
            source.location,
            revision=commit,
            local_dir=dest,
            cache_dir=state_dir(dest) / "hub-cache",
            endpoint=endpoint,
            token=token,
            tqdm_class=progress_class(),
            max_workers=4,
        )
    manifest = Manifest(source.uri, commit)
    for path, entry in sorted(listing.items()):
        target = dest / path
        if not target.is_file():
            raise IntegrityError(f"{path}: listed by the hub but missing after the download")
        check_size(target, path, entry.size)
        sha256 = entry.lfs.sha256 if entry.lfs is not None else None
        if sha256:
            check_digest(target, path, "sha256", sha256)
        manifest.files[path] = FileEntry(size=entry.size, etag=entry.blob_id, sha256=sha256)
    remove_abandoned_partials(dest)
    return manifest


def remove_abandoned_partials(dest: Path) -> None:
    """Files a killed run left behind (huggingface_hub names each attempt uniquely)."""
    for leftover in (dest / HUB_METADATA_DIR).glob("huggingface/download/**/*.incomplete"):
        leftover.unlink(missing_ok=True)


class translated_errors:
    """Turns huggingface_hub's exceptions into the download's typed failures."""

    def __init__(self, source: Source, token: str | None) -> None:
        self.source = source
        self.token = token

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, error: BaseException | None, traceback: object) -> bool:
        if error is None:
            return False
        import httpx2
        from huggingface_hub import errors

        uri, revision = self.source.uri, self.source.revision or "main"
        with_token = (
            "with the token in HF_TOKEN" if self.token else "without a token (HF_TOKEN unset)"
        )
        if isinstance(error, errors.GatedRepoError):
            raise AuthError(
                f"{uri}: the repository is gated; accept its terms on the hub and use a token "
                f"of an account that did (tried {with_token})"
            ) from error
        if isinstance(error, errors.RevisionNotFoundError):
            raise NotFoundError(f"{uri}: revision {revision!r} does not exist") from error
        if isinstance(error, errors.RepositoryNotFoundError):
            raise NotFoundError(
                f"{uri}: repository not found, or private and not readable {with_token}"
            ) from error
        if isinstance(error, errors.RemoteEntryNotFoundError):
            raise NotFoundError(f"{uri}: a listed file is missing on the hub: {error}") from error
        if isinstance(error, errors.HfHubHTTPError):
            status = error.response.status_code if error.response is not None else 0
            if status in (401, 403):
                raise AuthError(
                    f"{uri}: the hub refused the credentials (HTTP {status}) {with_token}"
                ) from error
            if status == 404:
                raise NotFoundError(f"{uri}: not found on the hub (HTTP 404)") from error
            raise NetworkError(f"{uri}: the hub answered HTTP {status}") from error
        if isinstance(error, httpx2.HTTPError | errors.LocalEntryNotFoundError):
            raise NetworkError(f"{uri}: hub unreachable: {error}") from error
        return False
