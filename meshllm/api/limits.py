"""Limits that keep one client from exhausting a node.

The body limit refuses oversized requests (413) without buffering them, and bounds how long a body
may take to arrive (408). The admission limit bounds generations in progress on the node; a request
over it waits, fairly and for a bounded time, for a place, and is otherwise refused with 429 and
``Retry-After`` (which OpenAI clients honour and retry) instead of waiting without a deadline.
Connection counts and header deadlines live in :mod:`meshllm.api.connections`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshllm.engine.fair_queue import FairQueue, QueueFull
from meshllm.runtime.errors import ApiError, BodyTooLarge, RequestTimeout, Saturated, error_for


@dataclass(frozen=True)
class ApiLimits:
    """Bounds on what one node's API accepts."""

    max_body_bytes: int = 4 * 1024 * 1024
    """Larger request bodies get 413 (4 MiB holds a long conversation)."""
    max_concurrent: int = 64
    """Generations in progress at once, across all models."""
    queue_timeout_s: float = 30.0
    """How long a request over ``max_concurrent`` waits for a place before a 429."""


def client_key(user: str | None, http: Request) -> str:
    """Who a request comes from, for fair shares: its ``user`` if it names one, else its HTTP connection."""
    if user:
        return f"user:{user}"
    peer = http.client
    return f"conn:{peer.host}:{peer.port}" if peer is not None else "conn:unknown"


@dataclass(frozen=True)
class EdgeLimits:
    """Bounds on HTTP connections, so that no client can hold the node's sockets or stall a read."""

    max_connections: int = 512
    """Open connections at once (the node keeps it under a quarter of its descriptor limit). At the cap,
    a new connection closes the oldest one that has no request in progress (idle, or still sending
    its headers); only when every one is serving a request is it refused (503)."""
    header_timeout_s: float = 10.0
    """A request's line and headers must arrive within this, counted from when the connection was ready for
    them (a slow-loris client dripping bytes is cut off; a fresh byte does not restart the clock)."""
    body_timeout_s: float = 60.0
    """The whole body must arrive within this, counted from its headers (408 after)."""
    max_drain_bytes: int = 64 * 1024 * 1024
    """An over-size body up to this size is read and dropped before the 413, so the client, still sending,
    gets the answer rather than a reset connection; larger ones are answered at once and the connection
    closed."""


class Admission:
    """Generations in progress on this node, and a bounded, fair wait for a place.

    At most ``limit`` generations run at once. A request over it waits in a
    :class:`~meshllm.engine.fair_queue.FairQueue` of ``max_waiting`` places (default ``limit``) for
    at most ``timeout_s``: clients take turns, and each may hold its share of the places. A request
    that finds no place it may take, or waits too long, gets :class:`~meshllm.runtime.errors.Saturated`
    (429) with a ``Retry-After`` estimated from how fast places have been freed.
    """

    def __init__(self, limit: int, timeout_s: float, max_waiting: int | None = None) -> None:
        self.limit = limit
        self.timeout_s = timeout_s
        self.active = 0
        self._queue: FairQueue[asyncio.Future[None]] = FairQueue(limit if max_waiting is None else max_waiting)
        self._release_interval_s = 1.0
        """Recent time between two freed places (an exponential average)."""
        self._last_release = time.monotonic()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def retry_after_s(self) -> float:
        """When a place is likely free: the queue ahead, at the rate places have been freed."""
        return min(60.0, max(1.0, self._release_interval_s * (len(self._queue) + 1)))

    async def acquire(self, client: str = "") -> None:
        """Take a place, waiting fairly for at most ``timeout_s``; raises :class:`Saturated`."""
        if self.active < self.limit and not self._queue:
            self.active += 1
            return
        place: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            displaced = self._queue.push(place, client, time.monotonic())
        except QueueFull as exc:
            raise Saturated(f"all {self.limit} request places of this node are busy and {exc}",
                            retry_after_s=self.retry_after_s()) from None
        for other in displaced:
            other.set_exception(Saturated("this node's queue is full and this client held more than its share of it",
                                          retry_after_s=self.retry_after_s()))
        try:
            async with asyncio.timeout(self.timeout_s):
                await place
        except TimeoutError:
            self._queue.remove(place)
            raise Saturated(f"all {self.limit} request places of this node are busy (waited {self.timeout_s:g}s)",
                            retry_after_s=self.retry_after_s()) from None
        except BaseException:
            if not self._queue.remove(place) and place.done() and not place.cancelled() and place.exception() is None:
                self.release()  # granted just as the caller gave up
            raise

    def release(self) -> None:
        """Give a place back (exactly once per successful ``acquire``); the next waiter takes it."""
        self.active -= 1
        now = time.monotonic()
        self._release_interval_s = 0.8 * self._release_interval_s + 0.2 * (now - self._last_release)
        self._last_release = now
        while self.active < self.limit and self._queue:
            place = self._queue.pop()
            if not place.done():
                self.active += 1
                place.set_result(None)


class BodyLimit:
    """ASGI middleware: 413 for bodies over ``limit`` bytes (by header or by counting), 408 for slow ones.

    The body is read up front (it is at most ``limit`` bytes) and replayed to the app; later
    ``receive`` calls go to the server, so disconnect notices still reach streaming responses.

    A 413 sent while the client is still uploading, followed by closing the connection, is often
    lost: the close resets the connection with the client's bytes unread and the client sees the
    reset, not the answer. So an over-size body is read to its end and dropped (up to
    ``drain_limit`` bytes, bounded in time like any body) and the 413 leaves on a connection that
    stays usable. Only a body larger than ``drain_limit``, or one the client has not sent yet
    (``Expect: 100-continue``), is answered at once, with ``connection: close``.
    """

    def __init__(self, app: ASGIApp, limit: int, drain_limit: int | None = None, timeout_s: float = 60.0) -> None:
        self.app = app
        self.limit = limit
        self.drain_limit = max(limit, drain_limit if drain_limit is not None else limit)
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared_text = headers.get(b"content-length", b"")
        declared = int(declared_text) if declared_text.isdigit() else None
        if declared is not None and declared > self.limit and (
                declared > self.drain_limit or b"100-continue" in headers.get(b"expect", b"").lower()):
            await self._answer(send, self._too_large(), close=True)
            return
        body: bytearray | None = bytearray()
        received = 0
        try:
            async with asyncio.timeout(self.timeout_s):
                more = True
                while more:
                    message = await receive()
                    if message["type"] != "http.request":
                        if body is None:
                            return  # the client left in the middle of an over-size body: nobody to answer
                        break  # client went away: the app sees an empty body and the disconnect later
                    chunk = message.get("body", b"")
                    received += len(chunk)
                    more = message.get("more_body", False)
                    if received > self.limit:
                        body = None  # over the limit: count what is left, keep none of it
                        if received > self.drain_limit:
                            await self._answer(send, self._too_large(), close=True)
                            return
                    elif body is not None:
                        body += chunk
        except TimeoutError:
            await self._answer(send, RequestTimeout(f"the request body did not arrive within {self.timeout_s:g} s"),
                               close=True)
            return
        if body is None:
            await self._answer(send, self._too_large(), close=False)
            return
        data = bytes(body)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": data, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self) -> BodyTooLarge:
        return BodyTooLarge(f"request body exceeds the {self.limit}-byte limit")

    @staticmethod
    async def _answer(send: Send, exc: ApiError, *, close: bool) -> None:
        status, body = error_for(exc)
        response = JSONResponse(body, status_code=status, headers={"connection": "close"} if close else None)
        await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}
