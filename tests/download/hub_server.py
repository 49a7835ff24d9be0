"""A local HTTP server that answers the Hugging Face Hub API calls ``snapshot_download``
makes, for a folder laid out as ``ROOT/ORG/NAME/COMMIT/<files>`` plus ``ROOT/ORG/NAME/refs.json``
(``{"main": COMMIT, ...}``) and an optional ``private`` marker file.

Calls served (as huggingface_hub 1.x/2.x makes them): ``GET /api/models/REPO/revision/REV``
(repo info, resolves a branch or tag to a commit), ``GET /api/models/REPO/tree/REV?recursive=``
(the file listing with sizes, blob ids and LFS SHA-256), and ``HEAD``/``GET``
``/REPO/resolve/REV/PATH`` with the headers the client reads (``X-Repo-Commit``, ``ETag``,
``X-Linked-Etag``/``X-Linked-Size`` for LFS files, ``Content-Length``) and byte ranges.
Errors carry the hub's ``X-Error-Code``/``X-Error-Message`` headers, which the client maps to
its typed exceptions.

Tests can make a file's GET stall after some bytes (to interrupt a download at a known point)
and read back every request made.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")


@dataclass
class HubRequest:
    method: str
    path: str
    range: str | None
    authorization: str | None


@dataclass
class HubState:
    root: Path
    tokens: set[str] = field(default_factory=set)
    stall_after: dict[str, int] = field(default_factory=dict)  # file path -> bytes, once
    requests: list[HubRequest] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)


def git_blob_id(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content, usedforsecurity=False).hexdigest()


def file_info(path: Path, relative: str) -> dict[str, Any]:
    content = path.read_bytes()
    info: dict[str, Any] = {"type": "file", "path": relative, "size": len(content)}
    if relative.endswith(LFS_SUFFIXES):
        sha256 = hashlib.sha256(content).hexdigest()
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(content)}\n"
        info["oid"] = git_blob_id(pointer.encode())
        info["lfs"] = {"oid": sha256, "size": len(content), "pointerSize": len(pointer)}
    else:
        info["oid"] = git_blob_id(content)
    return info


class HubHandler(BaseHTTPRequestHandler):
    state: HubState
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def do_HEAD(self) -> None:  # noqa: N802
        self._handle(send_body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._handle(send_body=True)

    # --- routing ------------------------------------------------------------------------------

    def _handle(self, *, send_body: bool) -> None:
        path = urlsplit(self.path).path
        self.state.requests.append(
            HubRequest(
                self.command, path, self.headers.get("Range"), self.headers.get("Authorization")
            )
        )
        parts = [unquote(part) for part in path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo, kind, revision = "/".join(parts[2:4]), parts[4], parts[5]
            self._api(repo, kind, revision, send_body)
        elif len(parts) >= 5 and parts[2] == "resolve":
            self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]), send_body)
        else:
            self._error(404, "EntryNotFound", "no such route")

    def _repo(self, repo: str, revision: str) -> tuple[Path, str] | None:
        """(commit folder, commit) after the auth and existence checks; None when answered."""
        folder = self.state.root / repo
        authorization = self.headers.get("Authorization")
        token = authorization.removeprefix("Bearer ").strip() if authorization else None
        if token is not None and token not in self.state.tokens:
            self._error(401, None, "Invalid credentials in Authorization header")
            return None
        if not (folder / "refs.json").is_file() or (
            (folder / "private").exists() and token is None
        ):
            self._error(404 if token else 401, "RepoNotFound", "Repository not found")
            return None
        refs = json.loads((folder / "refs.json").read_text())
        commit = refs.get(revision, revision)
        if not (folder / commit).is_dir():
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return folder / commit, commit

    def _api(self, repo: str, kind: str, revision: str, send_body: bool) -> None:
        found = self._repo(repo, revision)
        if found is None:
            return
        folder, commit = found
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        if kind == "revision":
            body: Any = {
                "id": repo,
                "modelId": repo,
                "sha": commit,
                "private": (self.state.root / repo / "private").exists(),
                "siblings": [{"rfilename": p.relative_to(folder).as_posix()} for p in files],
            }
        else:
            body = [file_info(p, p.relative_to(folder).as_posix()) for p in files]
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if send_body:
            self.wfile.write(data)

    def _resolve(self, repo: str, revision: str, relative: str, send_body: bool) -> None:
        found = self._repo(repo, revision)
        if found is None:
            return
        folder, commit = found
        target = folder / relative
        if not target.is_file():
            self._error(404, "EntryNotFound", f"{relative} does not exist")
            return
        content = target.read_bytes()
        info = file_info(target, relative)
        start = 0
        if send_body and self.headers.get("Range", "").startswith("bytes="):
            start = int(self.headers["Range"].removeprefix("bytes=").split("-")[0])
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("Accept-Ranges", "bytes")
        if "lfs" in info:
            self.send_header("ETag", f'"{info["oid"]}"')
            self.send_header("X-Linked-Etag", f'"{info["lfs"]["oid"]}"')
            self.send_header("X-Linked-Size", str(len(content)))
        else:
            self.send_header("ETag", f'"{info["oid"]}"')
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(content) - 1}/{len(content)}")
        self.send_header("Content-Length", str(len(content) - start))
        self.end_headers()
        if not send_body:
            return
        stall = self.state.stall_after.pop(relative, None)
        if stall is not None:
            self.wfile.write(content[start:stall])
            self.wfile.flush()
            self.state.release.wait(timeout=120)  # the test kills the client meanwhile
            self.close_connection = True
            return
        self.wfile.write(content[start:])

    def _error(self, status: int, code: str | None, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


class HubServer:
    """Serves ``root`` on 127.0.0.1 in a thread; ``url`` is the HF_ENDPOINT to use."""

    def __init__(self, root: Path, tokens: set[str] | None = None) -> None:
        self.state = HubState(root=root, tokens=set(tokens or ()))
        handler = type("Handler", (HubHandler,), {"state": self.state})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> HubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.state.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def add_commit(
    root: Path, repo: str, commit: str, files: dict[str, bytes], refs: tuple[str, ...] = ()
) -> None:
    """Puts ``files`` in ``repo`` at ``commit``, pointing each ref in ``refs`` at it."""
    folder = root / repo / commit
    for relative, content in files.items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_bytes(content)
    refs_path = root / repo / "refs.json"
    known = json.loads(refs_path.read_text()) if refs_path.exists() else {}
    known.update({ref: commit for ref in refs})
    refs_path.write_text(json.dumps(known))
