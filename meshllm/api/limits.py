"""Limits that keep one client from exhausting a node.

The body limit refuses oversized requests (413) before they are buffered in full. The admission
limit bounds requests being generated at once; a request over it waits at most
``queue_timeout_s`` for a slot and then gets a 503 instead of waiting without a deadline.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshllm.api.errors import BodyTooLarge, NoCapacity, error_for


@dataclass(frozen=True)
class ApiLimits:
    """Bounds on what one node's API accepts."""

    max_body_bytes: int = 4 * 1024 * 1024
    """Larger request bodies get 413 (4 MiB holds a long conversation)."""
    max_concurrent: int = 64
    """Generations in progress at once, across all models."""
    queue_timeout_s: float = 30.0
    """How long a request over ``max_concurrent`` waits for a slot before a 503."""


class Admission:
    """A counting slot limit with a bounded wait, shared by the generation routes."""

    def __init__(self, limit: int, timeout_s: float) -> None:
        self.limit = limit
        self.timeout_s = timeout_s
        self.active = 0
        self._sem = asyncio.Semaphore(limit)

    async def acquire(self) -> None:
        """Take a slot or raise :class:`NoCapacity` after ``timeout_s``."""
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._sem.acquire()
        except TimeoutError:
            raise NoCapacity(f"all {self.limit} request slots of this node are busy "
                             f"(waited {self.timeout_s:g}s)") from None
        self.active += 1

    def release(self) -> None:
        """Give a slot back (exactly once per successful ``acquire``)."""
        self.active -= 1
        self._sem.release()


class Slots:
    """A counting limit that never waits: a full node refuses at once, so the caller fails over."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0

    def try_take(self) -> bool:
        """Take a slot if one is free."""
        if self.active >= self.limit:
            return False
        self.active += 1
        return True

    def give_back(self) -> None:
        """Return a slot taken with :meth:`try_take`."""
        self.active -= 1


class BodyLimit:
    """ASGI middleware: 413 for bodies over ``limit`` bytes, by header or by counting.

    The body is read up front (it is at most ``limit`` bytes) and replayed to the app; later
    ``receive`` calls go to the server, so disconnect notices still reach streaming responses.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(send)
            return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break  # client went away: the app sees an empty body and the disconnect later
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                await self._refuse(send)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        status, body = error_for(BodyTooLarge(f"request body exceeds the {self.limit}-byte limit"))
        response = JSONResponse(body, status_code=status, headers={"connection": "close"})
        await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}
