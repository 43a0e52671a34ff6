"""Shared helpers for the transport tests: endpoints on 127.0.0.1 and in-memory aioquic pairs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
from nacl.signing import SigningKey

from meshllm.net import Endpoint, EndpointOptions
from meshllm.net.quic import MeshQuicConnection, make_configuration


class Msg(msgspec.Struct):
    text: str


def accept_all(peer: str, proof: bytes, dialer: bool) -> None:
    """An admit callback that admits everyone."""


async def endpoint(
    key: SigningKey | None = None,
    *,
    admit: Callable[[str, bytes, bool], None] = accept_all,
    proof: bytes = b"proof",
    port: int = 0,
    **options: object,
) -> Endpoint:
    return await Endpoint.create(
        key or SigningKey.generate(), "127.0.0.1", port, admit=admit, local_proof=lambda: proof,
        options=EndpointOptions(**options),  # type: ignore[arg-type]
    )


async def until(predicate: Callable[[], bool], timeout: float = 3.0) -> None:
    """Wait for a condition driven by real network I/O (no clock to pass in there)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def quic_pair(
    client_key: SigningKey, server_key: SigningKey, *, window: int = 1 << 20
) -> tuple[MeshQuicConnection, MeshQuicConnection]:
    """A client and server MeshQuicConnection, handshaken in memory (sans-IO, fake clock)."""
    client = MeshQuicConnection(configuration=make_configuration(client_key, is_client=True, stream_window=window))
    server_cfg = make_configuration(server_key, is_client=False, stream_window=window)
    client.connect(("10.0.0.2", 4433), now=0.0)
    server: MeshQuicConnection | None = None
    for _ in range(10):
        for data, _addr in client.datagrams_to_send(now=0.0):
            if server is None:
                odcid = client.original_destination_connection_id
                server = MeshQuicConnection(configuration=server_cfg, original_destination_connection_id=odcid)
            server.receive_datagram(data, ("10.0.0.1", 1234), now=0.0)
        assert server is not None
        for data, _addr in server.datagrams_to_send(now=0.0):
            client.receive_datagram(data, ("10.0.0.2", 4433), now=0.0)
    assert server is not None
    return client, server


def pump(a: MeshQuicConnection, b: MeshQuicConnection, now: float = 1.0, rounds: int = 100) -> float:
    """Exchange datagrams between two in-memory connections, 10 ms of fake time a round."""
    for _ in range(rounds):
        now += 0.01
        for conn in (a, b):
            timer = conn.get_timer()
            if timer is not None and timer <= now:
                conn.handle_timer(now)
        for data, _ in a.datagrams_to_send(now=now):
            b.receive_datagram(data, ("10.0.0.1", 1234), now=now)
        for data, _ in b.datagrams_to_send(now=now):
            a.receive_datagram(data, ("10.0.0.2", 4433), now=now)
    return now
