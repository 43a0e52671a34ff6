"""A local stand-in for the Hugging Face hub: the endpoints ``huggingface_hub`` calls to download a file.

- ``HEAD|GET /{org}/{repo}/resolve/{revision}/{path}``: the file, with ``X-Repo-Commit``, the LFS
  ``ETag`` (the sha256), ``Content-Length`` and ``Accept-Ranges``; ``Range: bytes=N-`` answers 206.
- ``GET /api/models/{org}/{repo}/tree/{revision}``: the repository's files (for ``:QUANT`` matching).
- Unknown repositories answer 404 with ``X-Error-Code: RepoNotFound``, unknown files ``EntryNotFound``.

``throttle`` (bytes per second) makes a download slow enough to interrupt; every GET's ``Range``
header is recorded in ``ranges`` so a test can see a resume ask for the rest only.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Hub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.throttle: float | None = None
        self.ranges: list[str | None] = []
        self.url = ""

    def add(self, repo: str, name: str, data: bytes) -> None:
        self.repos.setdefault(repo, {})[name] = data


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_: object) -> None:
            pass

        def _error(self, code: str) -> None:
            body = json.dumps({"error": code}).encode()
            self.send_response(404)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_HEAD(self) -> None:
            self._serve()

        def do_GET(self) -> None:
            self._serve()

        def _serve(self) -> None:
            parts = unquote(urlparse(self.path).path).strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
                return self._tree("/".join(parts[2:4]))
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._file("/".join(parts[:2]), "/".join(parts[4:]))
            return self._error("RepoNotFound")

        def _tree(self, repo: str) -> None:
            files = hub.repos.get(repo)
            if files is None:
                return self._error("RepoNotFound")
            listing = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest(),
                        "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}}
                       for name, data in files.items()]
            body = json.dumps(listing).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return None

        def _file(self, repo: str, name: str) -> None:
            files = hub.repos.get(repo)
            if files is None:
                return self._error("RepoNotFound")
            data = files.get(name)
            if data is None:
                return self._error("EntryNotFound")
            start = 0
            asked = self.headers.get("Range")
            if self.command == "GET":
                hub.ranges.append(asked)
            if asked and asked.startswith("bytes="):
                start = int(asked[len("bytes="):].split("-")[0])
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if self.command == "HEAD":
                return None
            chunk = 32 * 1024
            for at in range(start, len(data), chunk):
                try:
                    self.wfile.write(data[at : at + chunk])
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    return None
                if hub.throttle:
                    time.sleep(chunk / hub.throttle)
            return None

    return Handler


@contextmanager
def hub_server() -> Iterator[Hub]:
    """A running local hub on 127.0.0.1 (its ``url`` goes into ``HF_ENDPOINT``)."""
    hub = Hub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
