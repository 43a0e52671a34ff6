"""HTTP edge limits on a real uvicorn server with the node's protocol: 413s that reach the client,
body and header deadlines, the connection cap (and its sans-IO table)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import select
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from api_server import serve
from fastapi import APIRouter, Depends
from nodes import wait_until

from meshllm.api.app import ApiLimits, EdgeLimits, LocalBackend, create_app
from meshllm.api.auth import require_api_key
from meshllm.api.connections import ConnectionTable, guarded_protocol
from meshllm.engine.llama import LlamaEngine

LIMIT = 256 * 1024
EDGE = EdgeLimits(header_timeout_s=1.0, body_timeout_s=1.0, max_drain_bytes=32 * 1024 * 1024)
CHAT = "/v1/chat/completions"


def sleep_router(release: threading.Event, entered: list[int] | None = None) -> APIRouter:
    """``GET /api/wait``: a request that stays in progress until ``release`` is set (each one that
    started appends to ``entered``)."""
    router = APIRouter(dependencies=[Depends(require_api_key)])

    @router.get("/api/wait")
    async def wait() -> dict[str, bool]:
        if entered is not None:
            entered.append(1)
        while not release.is_set():
            await asyncio.sleep(0.02)
        return {"done": True}

    return router


@pytest.fixture(scope="module")
def edge_server(tiny_engine: LlamaEngine) -> Iterator[str]:
    app = create_app(LocalBackend([tiny_engine]), ApiLimits(max_body_bytes=LIMIT), edge=EDGE)
    with serve(app, http=guarded_protocol(EDGE)) as url:
        yield url


def addr(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def read_all(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    with contextlib.suppress(TimeoutError, OSError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_forty_over_size_uploads_get_forty_clean_413s(edge_server: str) -> None:
    sizes = random.Random(7).sample(range(LIMIT + 1, 12 * 1024 * 1024), 40)
    statuses = []
    with httpx.Client(timeout=30) as client:
        for size in sizes:
            answer = client.post(edge_server + CHAT, content=b"x" * size, headers={"content-type": "application/json"})
            statuses.append((answer.status_code, answer.json()["error"]["code"]))
        assert client.get(edge_server + "/health").status_code == 200, "the kept-alive connection is still usable"
    assert statuses == [(413, "request_too_large")] * 40


def test_an_over_size_body_without_a_length_is_counted_and_refused(edge_server: str) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(64):
            yield b"y" * 65536

    answer = httpx.post(edge_server + CHAT, content=chunks(), timeout=30)
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "request_too_large"


def test_a_body_too_big_to_drain_is_refused_at_once(edge_server: str) -> None:
    with socket.create_connection(addr(edge_server)) as sock:
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-length: {1 << 30}\r\n\r\n".encode())
        answer = read_all(sock, 3.0)
    assert answer.startswith(b"HTTP/1.1 413") and b"connection: close" in answer.lower()


def test_expect_100_continue_is_answered_before_the_body_is_sent(edge_server: str) -> None:
    with socket.create_connection(addr(edge_server)) as sock:
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nexpect: 100-continue\r\n"
                     f"content-length: {LIMIT + 1}\r\n\r\n".encode())
        answer = read_all(sock, 3.0)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:80]


def test_a_body_that_does_not_arrive_in_time_is_a_408(edge_server: str) -> None:
    started = time.monotonic()
    with socket.create_connection(addr(edge_server)) as sock:
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-length: 100\r\n\r\n{{".encode())
        answer = read_all(sock, 5.0)
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
    assert time.monotonic() - started < EDGE.body_timeout_s + 3


def test_headers_that_do_not_arrive_in_time_end_the_connection(edge_server: str) -> None:
    started = time.monotonic()
    with socket.create_connection(addr(edge_server)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        for _ in range(20):  # a byte every 0.2 s does not restart the clock
            time.sleep(0.2)
            if select.select([sock], [], [], 0)[0]:
                break  # answered (or closed): read below what
            with contextlib.suppress(OSError):
                sock.send(b"x")
        answer = read_all(sock, 3.0)
    assert answer.startswith(b"HTTP/1.1 408")
    assert time.monotonic() - started < EDGE.header_timeout_s + 5
    with socket.create_connection(addr(edge_server)) as silent:  # it may be a client whose request is unread
        assert read_all(silent, EDGE.header_timeout_s + 3).startswith(b"HTTP/1.1 408")
    with socket.create_connection(addr(edge_server)) as idle:  # an idle keep-alive connection is simply closed
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = read_all(idle, EDGE.header_timeout_s + 3)
        assert answer.startswith(b"HTTP/1.1 200") and b"408" not in answer


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (with or without a 408 or a 503); False while it stays open."""
    sock.settimeout(0.05)
    try:
        data = sock.recv(65536)
    except TimeoutError:
        return False
    except OSError:
        return True
    return data == b"" or data.startswith((b"HTTP/1.1 408", b"HTTP/1.1 503"))


def test_at_the_cap_waiting_connections_make_room_and_busy_ones_do_not(tiny_engine: LlamaEngine) -> None:
    edge = EdgeLimits(max_connections=16, header_timeout_s=30.0)
    release = threading.Event()
    entered: list[int] = []
    app = create_app(LocalBackend([tiny_engine]), routers=[sleep_router(release, entered)], edge=edge)
    with serve(app, http=guarded_protocol(edge)) as url:
        waiting = []
        for _ in range(edge.max_connections * 2):
            waiting.append(socket.create_connection(addr(url)))
            waiting[-1].sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        try:
            assert httpx.get(url + "/health", timeout=5).status_code == 200, "the oldest waiter made room"
            closed = [closed_by_server(sock) for sock in waiting]
            assert closed == [True] * (edge.max_connections + 1) + [False] * (edge.max_connections - 1), closed
        finally:
            for sock in waiting:
                sock.close()
        with httpx.Client(timeout=10, limits=httpx.Limits(max_connections=64)) as client:
            busy = [threading.Thread(target=client.get, args=(url + "/api/wait",)) for _ in range(edge.max_connections)]
            for thread in busy:
                thread.start()
            wait_until(lambda: len(entered) == edge.max_connections, 10.0)  # every connection is busy
            try:
                with socket.create_connection(addr(url)) as sock:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                    refused = read_all(sock, 3.0)
                assert refused.startswith(b"HTTP/1.1 503") and b"no_capacity" in refused
            finally:
                release.set()
                for thread in busy:
                    thread.join(10)
        assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_connection_table_evicts_the_oldest_waiter_only() -> None:
    table = ConnectionTable(2)
    assert table.open("a") == (True, None) and table.open("b") == (True, None)
    table.busy("a")
    assert table.open("c") == (True, "b"), "b waits for its request; a is serving one"
    table.busy("c")
    assert table.open("d") == (False, None), "everyone is busy: refuse"
    table.idle("a")
    assert table.open("d") == (True, "a")
    table.closed("c")
    table.closed("d")
    assert len(table) == 0
