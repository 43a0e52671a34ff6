"""A virtual path: the packets of one QUIC connection carried inside a relay stream.

The :class:`~meshllm.net.endpoint.Endpoint` routes by connection id and sends by address. A
relayed connection gets a *virtual* address (``relay:<relay id>:<n>``, port 0) instead of a UDP
one; the endpoint hands packets for that address to the :class:`RelayChannel`, which frames each
one on the circuit's stream, and feeds packets read from the stream back in as if they had come
from the socket. aioquic never knows: to it this is one more network path.

Sending never blocks (aioquic's transmit is synchronous): packets queue, and when the queue is
full the newest is dropped, which is exactly what a congested UDP path does and what QUIC's loss
recovery and congestion control already handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable

from meshllm.errors import MeshllmError
from meshllm.net.messages import Addr
from meshllm.net.streams import Stream

log = logging.getLogger(__name__)

QUEUE_PACKETS = 512
"""Packets a channel holds before it drops (about 700 KB of 1452-byte packets)."""
_counter = itertools.count(1)


def virtual_addr(relay_id: str) -> Addr:
    """A fresh address that names one circuit through ``relay_id`` (never an IP literal)."""
    return (f"relay:{relay_id[:16]}:{next(_counter)}", 0)


class RelayChannel:
    """Moves packets between the endpoint and one circuit stream, until either side ends."""

    def __init__(
        self,
        stream: Stream,
        addr: Addr,
        deliver: Callable[[bytes, Addr], None],
        on_close: Callable[[Addr, str], None],
    ) -> None:
        self.stream = stream
        self.addr = addr
        self._deliver = deliver
        self._on_close = on_close
        self._queue: asyncio.Queue[bytes] = asyncio.Queue(QUEUE_PACKETS)
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._write())]
        self.closed = False
        self._closed_event = asyncio.Event()

    def send(self, packet: bytes) -> None:
        """Queue one packet for the circuit (dropped when the queue is full or the channel closed)."""
        if self.closed:
            return
        with contextlib.suppress(asyncio.QueueFull):  # a full queue drops, like a congested UDP path
            self._queue.put_nowait(packet)

    def close(self, reason: str = "channel closed") -> None:
        """End the circuit stream and stop both pumps; the endpoint is told once."""
        if self.closed:
            return
        self.closed = True
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self.stream.reset()
        self._closed_event.set()
        self._on_close(self.addr, reason)

    async def wait_closed(self) -> None:
        await self._closed_event.wait()

    async def _read(self) -> None:
        reason = "relay ended the circuit"
        try:
            while (packet := await self.stream.recv(bytes, timeout=None)) is not None:
                self._deliver(packet, self.addr)
        except MeshllmError as exc:
            reason = f"circuit failed: {exc}"
        self.close(reason)

    async def _write(self) -> None:
        with contextlib.suppress(MeshllmError):
            while True:
                await self.stream.send(await self._queue.get(), timeout=None)
        self.close("circuit write failed")
