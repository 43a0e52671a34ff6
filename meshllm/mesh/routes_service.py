"""A member's side of route tables: answers passive clients' pulls on ``routes`` streams.

The core is :class:`~meshllm.mesh.routes.RouteTableServer`; this driver reads one
:class:`~meshllm.mesh.routes.RoutesAsk` per stream within a deadline, answers from the gossip
view as it is now, and forgets the stream. It keeps nothing about the client: not its id, not
when it last asked.
"""

from __future__ import annotations

import time
from typing import Any

from meshllm.mesh.routes import ROUTES_STREAM, TABLE_MAX_BYTES, RoutesAsk, RoutesTable, RouteTableServer
from meshllm.mesh.service import MeshService
from meshllm.net.errors import NetTimeout
from meshllm.net.messages import ResetCode

ASK_TIMEOUT_S = 5.0
"""A client's ask must arrive whole within this long."""
REPLY_TIMEOUT_S = 10.0
"""The reply must be queued within this long (a client that grants no credit loses the stream)."""
REPLY_FRAME_MAX = TABLE_MAX_BYTES + 4096


class RouteService:
    """Serve route tables to passive clients from this member's gossip view."""

    def __init__(self, mesh: MeshService) -> None:
        assert mesh.endpoint is not None, "start the mesh service first"
        self.mesh = mesh
        self.core = RouteTableServer(mesh.key.signing_key, mesh.membership.mesh_id)
        self.pulls = 0
        """Pulls answered ..."""
        self.tables = 0
        """... of which with a whole table (the rest: the client's version was current). In ``/api/status``."""
        mesh.endpoint.on_stream(ROUTES_STREAM, self._serve, max_frame=REPLY_FRAME_MAX)

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

    def status(self) -> dict[str, int]:
        """``route_tables`` in ``/api/status``: what passive clients asked this member (no client named)."""
        return {"pulls": self.pulls, "tables": self.tables, "passive_connections": self._passive_connections()}

    def _passive_connections(self) -> int:
        assert self.mesh.endpoint is not None
        return sum(1 for conn in self.mesh.endpoint.peers.values() if conn.passive)
