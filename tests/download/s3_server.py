"""An S3 server on localhost for the download tests: moto in server mode, with IAM
authentication switched on (so a wrong key is refused as by AWS), behind a small forwarding
proxy that records each request's Range header and can stall an object's body after some
bytes, to interrupt a download at a known point."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from moto.server import ThreadedMotoServer

REGION = "us-east-1"
ALLOW_ALL = json.dumps(
    {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ProxyState:
    upstream: tuple[str, int]
    stall_after: dict[str, int] = field(default_factory=dict)  # URL path -> bytes, once
    ranges: list[tuple[str, str | None]] = field(default_factory=list)  # (path, Range) of GETs
    release: threading.Event = field(default_factory=threading.Event)


class ProxyHandler(BaseHTTPRequestHandler):
    state: ProxyState
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        path = self.path.split("?", 1)[0]
        if self.command == "GET":
            self.state.ranges.append((path, self.headers.get("Range")))
        connection = http.client.HTTPConnection(*self.state.upstream, timeout=60)
        connection.request(self.command, self.path, body=body, headers=dict(self.headers))
        response = connection.getresponse()
        content = response.read()
        self.send_response(response.status)
        for name, value in response.getheaders():
            if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        stall = self.state.stall_after.pop(path, None) if self.command == "GET" else None
        if stall is not None:
            self.wfile.write(content[:stall])
            self.wfile.flush()
            self.state.release.wait(timeout=120)  # the test kills the client meanwhile
            self.close_connection = True
            return
        if self.command != "HEAD":
            self.wfile.write(content)
        connection.close()

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward  # noqa: N815


class S3Server:
    """moto + proxy; ``url`` is the endpoint the downloader uses, ``moto_url`` the direct one."""

    def __init__(self) -> None:
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(), verbose=False)
        self.proxy_state: ProxyState | None = None
        self.proxy: ThreadingHTTPServer | None = None

    def __enter__(self) -> S3Server:
        self.moto.start()
        host, port = self.moto.get_host_and_port()
        self.proxy_state = ProxyState(upstream=(host, port))
        handler = type("Handler", (ProxyHandler,), {"state": self.proxy_state})
        self.proxy = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.proxy.daemon_threads = True
        threading.Thread(target=self.proxy.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._set_auth("inf")
        assert self.proxy is not None and self.proxy_state is not None
        self.proxy_state.release.set()
        self.proxy.shutdown()
        self.proxy.server_close()
        self.moto.stop()

    @property
    def moto_url(self) -> str:
        host, port = self.moto.get_host_and_port()
        return f"http://{host}:{port}"

    @property
    def url(self) -> str:
        assert self.proxy is not None
        return f"http://127.0.0.1:{self.proxy.server_address[1]}"

    def _set_auth(self, count: str) -> None:
        request = urllib.request.Request(
            self.moto_url + "/moto-api/reset-auth",
            data=count.encode(),
            method="POST",
            headers={"Content-Type": "text/plain"},  # a form body would hide the count
        )
        urllib.request.urlopen(request, timeout=10).close()

    def setup(self, objects: dict[str, dict[str, bytes]]) -> tuple[str, str]:
        """Creates the buckets and objects and an IAM user allowed everything; then turns
        authentication on. Returns that user's (access key id, secret access key)."""
        import boto3

        anonymous = {
            "endpoint_url": self.moto_url,
            "region_name": REGION,
            "aws_access_key_id": "setup",
            "aws_secret_access_key": "setup",
        }
        s3 = boto3.client("s3", **anonymous)
        for bucket, contents in objects.items():
            s3.create_bucket(Bucket=bucket)
            for key, data in contents.items():
                s3.put_object(Bucket=bucket, Key=key, Body=data)
        iam = boto3.client("iam", **anonymous)
        iam.create_user(UserName="loader")
        iam.put_user_policy(UserName="loader", PolicyName="all", PolicyDocument=ALLOW_ALL)
        key = iam.create_access_key(UserName="loader")["AccessKey"]
        self._set_auth("0")
        return key["AccessKeyId"], key["SecretAccessKey"]
