"""``pagoda download URI DIR``: model weights from where they live into a folder the engine loads.

Sources: ``hf://org/name[@revision]`` (the Hugging Face Hub or a mirror, through
huggingface_hub), ``s3://bucket/prefix`` (AWS S3 or any S3-compatible store, through boto3),
and local folders (``file:///path`` or a plain path, copied). ``pvc://claim/path`` is mounted
by the operator, not downloaded: in a pod it names the claim's mount, so it is refused here
with that explanation.

Every source is resumable (finished files are not fetched again; S3 continues a cut-off file
at the byte, the hub refetches it), every file is verified against the store's size and
checksum, and the folder counts as a finished download only once ``.pagoda/manifest.json``
is written, last. Failures are typed (``common.DownloadError`` subclasses) with distinct exit
codes, so a Kubernetes Job can stop retrying a wrong token but retry a network failure.

The operator's loader Job runs this command into the model cache volume (see
operator/README.md); the engine never downloads anything itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from inference.download.common import (
    DownloadError,
    FileEntry,
    InvalidSourceError,
    Manifest,
    NotFoundError,
    Stopwatch,
    check_size,
    logger,
    parse_source,
    remove_manifest,
    write_manifest,
)

__all__ = ["DownloadError", "Manifest", "download", "add_download_args", "run_download"]


def download(uri: str, dest: str | Path, *, endpoint_url: str | None = None) -> Manifest:
    """Brings ``dest`` to hold the model at ``uri``; returns what it holds. Raises a
    DownloadError subclass on failure (``dest`` then keeps what can be resumed)."""
    source = parse_source(uri)
    dest = Path(dest).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    stopwatch = Stopwatch()
    if source.scheme == "hf":
        from inference.download.hub import download_hub

        manifest = download_hub(source, dest, endpoint=endpoint_url)
    elif source.scheme == "s3":
        from inference.download.s3 import download_s3

        manifest = download_s3(source, dest, endpoint_url=endpoint_url)
    elif source.scheme == "pvc":
        raise InvalidSourceError(
            f"{uri}: a pvc:// source is mounted into the engine's pod by the operator, not "
            "downloaded; to copy a mounted folder, pass its path"
        )
    else:
        manifest = copy_folder(source.location, dest, uri)
    write_manifest(dest, manifest)
    logger.info(
        "%s is in %s: %d files, %d bytes, revision %s (%s)",
        uri, dest, len(manifest.files), manifest.num_bytes, manifest.revision,
        stopwatch.rate(manifest.num_bytes),
    )  # fmt: skip
    return manifest


def copy_folder(origin: str, dest: Path, uri: str) -> Manifest:
    """A local folder: nothing to do when it is the target, else a copy that skips files
    already there at the same size and modification time."""
    root = Path(origin).resolve()
    if not root.is_dir():
        raise NotFoundError(f"{uri}: no such folder")
    manifest = Manifest(uri, None)
    files = sorted(
        path for path in root.rglob("*") if path.is_file() and ".pagoda" not in path.parts
    )
    if root == dest:
        for path in files:
            manifest.files[path.relative_to(root).as_posix()] = FileEntry(path.stat().st_size)
        return manifest
    remove_manifest(dest)
    for path in files:
        relative = path.relative_to(root).as_posix()
        target = dest / relative
        stat = path.stat()
        if not (
            target.is_file()
            and target.stat().st_size == stat.st_size
            and int(target.stat().st_mtime) == int(stat.st_mtime)
        ):
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
        check_size(target, relative, stat.st_size)
        manifest.files[relative] = FileEntry(stat.st_size)
    return manifest


def add_download_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("uri", help="hf://ORG/NAME[@REVISION], s3://BUCKET/PREFIX or a folder")
    parser.add_argument("dest", help="the folder to fill (created if missing)")
    parser.add_argument(
        "--endpoint-url",
        default=None,
        help="S3-compatible store (default AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL) or hub "
        "mirror (default HF_ENDPOINT)",
    )
    parser.add_argument(
        "--result-file",
        default=None,
        help="write the outcome as JSON here (the loader Job uses /dev/termination-log)",
    )
    return parser


def run_download(args: argparse.Namespace) -> int:
    """The CLI: exit 0 when done, else the failure's exit code and a one-line message."""
    try:
        manifest = download(args.uri, args.dest, endpoint_url=args.endpoint_url)
    except DownloadError as error:
        logging.getLogger("inference.download").error("%s", error)
        _write_result(args.result_file, {"error": error.kind, "message": str(error)[:3000]})
        return error.exit_code
    _write_result(
        args.result_file,
        {
            "uri": manifest.uri,
            "revision": manifest.revision,
            "files": len(manifest.files),
            "bytes": manifest.num_bytes,
        },
    )
    return 0


def _write_result(path: str | None, result: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(result, sort_keys=True))
