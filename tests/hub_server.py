"""A local stand-in for the Hugging Face hub: the endpoints ``huggingface_hub`` calls to download a file.

- ``HEAD|GET /{org}/{repo}/resolve/{revision}/{path}``: the file, with ``X-Repo-Commit``, the LFS
  ``ETag`` (the sha256), ``Content-Length`` and ``Accept-Ranges``; ``Range: bytes=A-B`` or
  ``bytes=A-`` answers 206 with ``Content-Range``.
- With ``redirect`` set, that URL answers 302 (with ``X-Linked-Etag`` and ``X-Linked-Size``, as the
  hub does for LFS files) to ``/cdn/{org}/{repo}/{path}``, which serves the bytes.
- ``GET /api/models/{org}/{repo}/tree/{revision}``: the repository's files (for ``:QUANT`` matching).
- Unknown repositories answer 404 with ``X-Error-Code: RepoNotFound``, unknown files ``EntryNotFound``.

Faults a test can arm: ``throttle`` (bytes per second) makes a download slow enough to interrupt;
``fail_gets`` answers those GET numbers (counting from 1) with a 500; ``swap_after`` replaces a
file's bytes once that many GETs were answered (a new version: a new ETag); ``corrupt`` flips a
byte of the n-th GET from then on that covers a given offset (:meth:`Hub.corrupt_nth`). Every GET's
``Range`` header is recorded in ``ranges`` and the bytes sent are counted in ``bytes_sent``;
:meth:`Hub.wait_idle` waits until no connection is open (a killed client's requests already sent
are recorded by then).
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
        self.bytes_sent = 0
        self.url = ""
        self.redirect = False
        self.fail_gets: set[int] = set()
        self.swap_after: tuple[int, str, str, bytes] | None = None
        self.corrupt: dict[int, list[int]] = {}
        """offset -> [n, seen]: the n-th GET (from arming) whose range covers ``offset`` gets that byte flipped."""
        self.lock = threading.Lock()
        self.open = 0
        """Connections being handled now."""

    def add(self, repo: str, name: str, data: bytes) -> None:
        self.repos.setdefault(repo, {})[name] = data

    def corrupt_nth(self, offset: int, n: int) -> None:
        """Flip byte ``offset`` in the ``n``-th GET from now whose range covers it."""
        with self.lock:
            self.corrupt[offset] = [n, 0]

    def gets(self) -> int:
        return len(self.ranges)

    def wait_idle(self, timeout: float) -> None:
        """Wait until every connection is closed: a client killed with a request already sent still has
        it parsed and recorded by its handler thread, possibly after the kill."""
        deadline = time.monotonic() + timeout
        while self.open:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.open} hub connections still open after {timeout} s")
            time.sleep(0.02)


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            with hub.lock:
                hub.open += 1
            super().setup()

        def finish(self) -> None:
            try:
                super().finish()
            finally:
                with hub.lock:
                    hub.open -= 1

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
                if hub.redirect:
                    return self._redirect("/".join(parts[:2]), "/".join(parts[4:]))
                return self._file("/".join(parts[:2]), "/".join(parts[4:]))
            if len(parts) >= 4 and parts[0] == "cdn":
                return self._file("/".join(parts[1:3]), "/".join(parts[3:]))
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

        def _redirect(self, repo: str, name: str) -> None:
            data = hub.repos.get(repo, {}).get(name)
            if data is None:
                return self._error("EntryNotFound" if repo in hub.repos else "RepoNotFound")
            self.send_response(302)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("X-Linked-Etag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("Location", f"{hub.url}/cdn/{repo}/{name}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None

        def _file(self, repo: str, name: str) -> None:
            files = hub.repos.get(repo)
            if files is None:
                return self._error("RepoNotFound")
            asked = self.headers.get("Range")
            with hub.lock:
                if self.command == "GET":
                    hub.ranges.append(asked)
                    number = len(hub.ranges)
                    if hub.swap_after is not None and number > hub.swap_after[0]:
                        _, srepo, sname, new = hub.swap_after
                        hub.repos[srepo][sname] = new
                        hub.swap_after = None
                data = files.get(name)
            if data is None:
                return self._error("EntryNotFound")
            if self.command == "GET" and number in hub.fail_gets:
                self.send_response(500)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            start, end = 0, len(data) - 1
            if asked and asked.startswith("bytes="):
                first, _, last = asked[len("bytes="):].partition("-")
                start = int(first)
                end = min(int(last), len(data) - 1) if last else len(data) - 1
            partial = bool(asked)
            body = data[start : end + 1]
            with hub.lock:
                for offset, armed in hub.corrupt.items():
                    if self.command == "GET" and start <= offset <= end:
                        armed[1] += 1
                        if armed[1] == armed[0]:
                            at = offset - start
                            body = body[:at] + bytes([body[at] ^ 0xFF]) + body[at + 1:]
            self.send_response(206 if partial else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(body)))
            if partial:
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
            self.end_headers()
            if self.command == "HEAD":
                return None
            chunk = 32 * 1024
            for at in range(0, len(body), chunk):
                try:
                    self.wfile.write(body[at : at + chunk])
                    with hub.lock:
                        hub.bytes_sent += len(body[at : at + chunk])
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
