"""A member's side of route tables: answers passive clients' pulls on ``routes`` streams, and hints them.

The core is :class:`~meshllm.mesh.routes.RouteTableServer`; this driver reads one
:class:`~meshllm.mesh.routes.RoutesAsk` per stream within a deadline, answers from the gossip
view as it is now, and forgets the stream. It keeps nothing about the client: not its id, not
when it last asked.

When a member joins or leaves this member's view, or changes the models it serves, every passive
client connected here gets one :class:`~meshllm.mesh.routes.RoutesChanged` datagram (coalesced, at
most one a second: :class:`~meshllm.mesh.routes.ChangeHints`), so an idle client, which pulls once a
minute, follows the mesh within a round trip instead.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec

from meshllm.mesh.routes import (
    ROUTES_STREAM,
    TABLE_MAX_BYTES,
    ChangeHints,
    RoutesAsk,
    RoutesChanged,
    RoutesTable,
    RouteTableServer,
    routing_key,
)
from meshllm.mesh.service import MeshService
from meshllm.net.errors import NetTimeout
from meshllm.net.messages import ResetCode

ASK_TIMEOUT_S = 5.0
"""A client's ask must arrive whole within this long."""
REPLY_TIMEOUT_S = 10.0
"""The reply must be queued within this long (a client that grants no credit loses the stream)."""
REPLY_FRAME_MAX = TABLE_MAX_BYTES + 4096


class RouteService:
    """Serve route tables to passive clients from this member's gossip view, and hint them of changes."""

    def __init__(self, mesh: MeshService) -> None:
        assert mesh.endpoint is not None, "start the mesh service first"
        self.mesh = mesh
        self.core = RouteTableServer(mesh.key.signing_key, mesh.membership.mesh_id)
        self.pulls = 0
        """Pulls answered ..."""
        self.tables = 0
        """... of which with a whole table (the rest: the client's version was current). In ``/api/status``."""
        self.hints = 0
        """Hint datagrams sent."""
        self._hints = ChangeHints()
        self._timer: asyncio.TimerHandle | None = None
        mesh.endpoint.on_stream(ROUTES_STREAM, self._serve, max_frame=REPLY_FRAME_MAX)
        mesh.on_change.append(self._changed)

    def stop(self) -> None:
        """No more hints (the node is stopping)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._changed in self.mesh.on_change:
            self.mesh.on_change.remove(self._changed)

    async def _serve(self, stream: Any, conn: Any) -> None:
        gossip = self.mesh.gossip
        assert gossip is not None
        try:
            ask = await stream.recv(RoutesAsk, timeout=ASK_TIMEOUT_S)
        except NetTimeout as exc:
            stream.fail(ResetCode.TIMEOUT, str(exc))
            return
        if ask is None:
            return
        reply = self.core.answer(ask, gossip.own, gossip.state.peers, time.time())
        await stream.send(reply, timeout=REPLY_TIMEOUT_S)
        self.pulls += 1
        self.tables += isinstance(reply, RoutesTable)

    def _changed(self) -> None:
        """The view or our models changed: check for a hint soon (one timer at a time coalesces a burst)."""
        if self._timer is None:
            now = time.time()
            self._timer = asyncio.get_running_loop().call_later(self._hints.next_check(now) - now, self._hint)

    def _hint(self) -> None:
        """One datagram to every passive connection, if what clients route on changed since the last hint."""
        self._timer = None
        gossip = self.mesh.gossip
        assert gossip is not None
        clients = self._clients()
        now = time.time()
        if not clients or not self._hints.check(routing_key(gossip.own, gossip.state.peers), now):
            return
        data = msgspec.msgpack.encode(RoutesChanged(self.core.version(gossip.own, gossip.state.peers, now)))
        self.hints += sum(conn.send_datagram(data) for conn in clients)

    def status(self) -> dict[str, int]:
        """``route_tables`` in ``/api/status``: what passive clients asked this member (no client named)."""
        return {"pulls": self.pulls, "tables": self.tables, "hints": self.hints,
                "passive_connections": len(self._clients())}

    def _clients(self) -> list[Any]:
        """The connections passive clients hold to us."""
        assert self.mesh.endpoint is not None
        return [conn for conn in self.mesh.endpoint.peers.values() if conn.passive]
