"""HTTP connections: a cap on how many are open, and a deadline for each request's headers.

uvicorn, left alone, accepts every connection and waits for its request without a deadline (its
keep-alive timer stops at the first byte and ``limit_concurrency`` only answers requests that
arrived), so a local process opening a thousand connections that never finish their headers
("slow loris") exhausts the node's file descriptors: ``/health`` stops answering and the node's
peers see it go quiet. The protocol here is uvicorn's h11 protocol with two additions:

- a :class:`ConnectionTable` caps open connections. At the cap, a new connection closes the
  oldest connection that has no request in progress (idle, or still sending its headers), since
  a real client sends its request at once and an attacker's half-open connections are exactly the
  ones that wait; only when every connection is serving a request is the newcomer refused;
- a header deadline: from the moment a connection is ready for a request (accepted, or its last
  response sent), the request line and headers must be complete within ``header_timeout_s``.
  Bytes that trickle in do not restart the clock. A connection that misses it is closed (with a
  408 when it had not been answered before; an idle keep-alive connection is simply closed).

**No accepted connection is closed without an answer** (issue 29: a burst of 2,000 chats lost
1,489 of them to silent closes). In a burst, the oldest waiting connections are real clients
whose request the loop has not read yet, so an evicted or refused connection gets a ``503`` with
``Retry-After``, and every refusal is a *lingering* close: the answer is written, our side is
shut for writing, and what the client still sends is read and dropped for up to
:data:`LINGER_S`, because closing a socket with unread bytes makes the kernel send a reset that
destroys the answer before the client reads it.

The body has its own deadline in :class:`~meshllm.api.limits.BodyLimit`.

Between the kernel and :meth:`GuardedH11Protocol.connection_made`, asyncio accepts up to the
listen backlog of sockets per wake-up, and hands each to its protocol a few loop iterations
later. Those sockets hold descriptors the cap cannot see yet, so the node listens with a small
backlog (:data:`ACCEPT_BACKLOG`) and keeps the cap well under its descriptor limit.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from meshllm.api.errors import BUSY_RETRY_AFTER_S
from meshllm.api.limits import EdgeLimits
from meshllm.runtime.errors import ApiError, NoCapacity, RequestTimeout, error_for

ACCEPT_BACKLOG = 64
"""Listen backlog, and so the most sockets asyncio accepts at one wake-up before protocols see them."""
LINGER_S = 1.0
"""How long a refused connection is drained after its answer before the socket is closed."""


class ConnectionTable:
    """Open connections, and which of them wait for a request (oldest first): sans-IO, no sockets."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._open: set[object] = set()
        self._waiting: OrderedDict[object, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    def open(self, conn: object) -> tuple[bool, object | None]:
        """Admit ``conn``: ``(admitted, victim)``, where ``victim`` is a waiting connection to close for it."""
        victim = None
        if len(self._open) >= self.limit:
            if not self._waiting:
                return False, None
            victim, _ = self._waiting.popitem(last=False)
            self._open.discard(victim)
        self._open.add(conn)
        self._waiting[conn] = None
        return True, victim

    def busy(self, conn: object) -> None:
        """``conn`` is serving a request: it cannot be evicted."""
        self._waiting.pop(conn, None)

    def idle(self, conn: object) -> None:
        """``conn`` finished a response and waits for the next request (the newest waiter)."""
        if conn in self._open:
            self._waiting[conn] = None
            self._waiting.move_to_end(conn)

    def closed(self, conn: object) -> None:
        """``conn`` is gone."""
        self._open.discard(conn)
        self._waiting.pop(conn, None)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the connection cap and the header deadline."""

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, table: ConnectionTable,
                 limits: EdgeLimits) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._table = table
        self._limits = limits
        self._deadline: asyncio.TimerHandle | None = None
        self._answered = False
        """A response went out on this connection (an idle keep-alive one may be closed plainly)."""
        self._refused = False
        """Refused and lingering: whatever arrives is dropped until the socket closes."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        admitted, victim = self._table.open(self)
        if isinstance(victim, GuardedH11Protocol):
            victim.expire(evicted=True)
        if not admitted:
            self._refuse(NoCapacity(f"all {self._table.limit} HTTP connections of this node are serving "
                                    "requests"), 503, "Service Unavailable")
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # answered and lingering: drained, never parsed
        super().data_received(data)
        if self._in_request():
            self._table.busy(self)
            self._disarm()

    def on_response_complete(self) -> None:
        self._answered = True
        super().on_response_complete()
        if not self.transport.is_closing() and not self._in_request():
            self._table.idle(self)
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._table.closed(self)
        super().connection_lost(exc)

    def expire(self, evicted: bool = False) -> None:
        """Close this connection, which has no request in progress: ``evicted`` for a newcomer (a 503 with
        ``Retry-After``), else past its header deadline (a 408, or a plain close of an idle keep-alive one)."""
        self._disarm()
        if self.transport.is_closing() or self._refused:
            return
        if evicted:
            self._refuse(NoCapacity(f"all {self._table.limit} HTTP connections of this node are taken; "
                                    "this one waited longest for its request"), 503, "Service Unavailable")
        elif self.conn.trailing_data[0] or not self._answered:
            self._refuse(RequestTimeout(f"the request headers did not arrive within "
                                        f"{self._limits.header_timeout_s:g} s"), 408, "Request Timeout")
        else:
            self.transport.close()

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self._limits.header_timeout_s, self.expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _refuse(self, exc: ApiError, status: int, reason: str) -> None:
        """Answer outside h11 (no request was parsed), then close lingering (see the module's docstring)."""
        _, body = error_for(exc)
        payload = json.dumps(body).encode()
        retry = f"retry-after: {BUSY_RETRY_AFTER_S}\r\n" if status == 503 else ""
        head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n{retry}"
                f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n")
        self._refused = True
        self._table.closed(self)
        transport = self.transport
        transport.write(head.encode() + payload)
        if transport.can_write_eof():
            transport.write_eof()
        self.loop.call_later(LINGER_S, transport.close)


def guarded_protocol(limits: EdgeLimits) -> Callable[..., GuardedH11Protocol]:
    """The ``http`` protocol factory for ``uvicorn.Config``: one connection table per server."""
    table = ConnectionTable(limits.max_connections)

    def make(config: Any, server_state: Any, app_state: dict[str, Any],
             _loop: asyncio.AbstractEventLoop | None = None) -> GuardedH11Protocol:
        return GuardedH11Protocol(config, server_state, app_state, _loop, table=table, limits=limits)

    return make
