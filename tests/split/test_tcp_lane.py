"""Stage lanes over the bulk channel (TLS on TCP): the same tokens as QUIC lanes, and QUIC when it fails."""

from __future__ import annotations

import asyncio
import socket
import struct
from pathlib import Path

import numpy as np
from split_helpers import make_chain, solo_greedy

from meshllm.models.bulk import FRAME_MAX, OpenLane
from meshllm.net import Stream, tcp_tls
from meshllm.split.tcp_lane import TcpStream
from meshllm.wire.frames import encode_frame

N = 8
PROMPT = [1, *np.random.default_rng(3).integers(3, 259, 299).tolist()]
"""Longer than a Prefill chunk (256 tokens): the prompt crosses each hop as two frames."""


def run_chain(path: Path, bulk_ports) -> tuple[list[int], list[type]]:  # type: ignore[no-untyped-def]
    async def main() -> tuple[list[int], list[type]]:
        chain = await make_chain(path, [0, 2, 4, 6], max_context=512, bulk_ports=bulk_ports)
        try:
            tokens = [t.token_id async for t in chain.coordinator.generate(PROMPT, max_tokens=N)]
            lanes = [type(lane.stream) for server in chain.servers for lane in server.pool._lanes.values()]
            return tokens, lanes
        finally:
            await chain.close()

    return asyncio.run(main())


def test_tcp_lanes_give_the_solo_tokens(tiny_model: Path) -> None:
    tokens, lanes = run_chain(tiny_model, lambda listening: lambda node: listening.get(node, 0))
    assert tokens == solo_greedy(tiny_model, PROMPT, N, max_context=512)
    # coordinator -> 1, 1 -> 2, and the last stage's Tokens -> coordinator: every lane rode TLS over TCP
    assert lanes == [TcpStream] * 3


def test_a_dead_bulk_port_leaves_the_lanes_on_quic(tiny_model: Path) -> None:


    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        dead = closed.getsockname()[1]
    tokens, lanes = run_chain(tiny_model, lambda listening: lambda node: dead)
    assert tokens == solo_greedy(tiny_model, PROMPT, N, max_context=512)
    assert lanes and all(issubclass(kind, Stream) for kind in lanes)


def test_a_listener_that_refuses_the_peer_leaves_the_lanes_on_quic(tiny_model: Path) -> None:
    """The listener checks admission after the TLS handshake: a refusal must not become a failed lane."""

    async def main() -> tuple[list[int], list[type]]:
        chain = await make_chain(tiny_model, [0, 3, 6], max_context=512,
                                 bulk_ports=lambda listening: lambda node: listening.get(node, 0))
        for channel in chain.bulk:
            channel.allowed = lambda peer: False
        try:
            tokens = [t.token_id async for t in chain.coordinator.generate(PROMPT, max_tokens=N)]
            return tokens, [type(lane.stream) for s in chain.servers for lane in s.pool._lanes.values()]
        finally:
            await chain.close()

    tokens, lanes = asyncio.run(main())
    assert tokens == solo_greedy(tiny_model, PROMPT, N, max_context=512)
    assert lanes and all(issubclass(kind, Stream) for kind in lanes)


def test_a_lane_sending_garbage_is_closed_and_the_stage_serves_on(tiny_model: Path) -> None:
    """A frame above the lane cap, then bytes that are not msgpack: each connection is cut, nothing else."""
    async def main() -> tuple[list[bytes], list[int]]:
        chain = await make_chain(tiny_model, [0, 3, 6], max_context=512,
                                 bulk_ports=lambda listening: lambda node: listening.get(node, 0))
        worker = chain.endpoints[1]
        _, client = tcp_tls.contexts(chain.keys[0])  # the coordinator's key: an admitted peer of the worker
        port = chain.bulk[1]._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        ends = []
        try:
            await chain.endpoints[0].connect(("127.0.0.1", worker.local_addr[1]), worker.node_id)  # admitted
            for junk in (struct.pack(">I", 64 * 1024 * 1024), struct.pack(">I", 3) + b"\xc1\xc1\xc1"):
                reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
                writer.write(encode_frame(OpenLane(), FRAME_MAX))
                echo = await asyncio.wait_for(reader.readexactly(len(encode_frame(OpenLane(), FRAME_MAX))), 5)
                writer.write(junk)
                ends.append(echo + await asyncio.wait_for(reader.read(), 5))  # b"" once the stage cut it
                writer.close()
            tokens = [t.token_id async for t in chain.coordinator.generate(PROMPT, max_tokens=N)]
            return ends, tokens
        finally:
            await chain.close()

    ends, tokens = asyncio.run(main())
    assert ends == [encode_frame(OpenLane(), FRAME_MAX)] * 2
    assert tokens == solo_greedy(tiny_model, PROMPT, N, max_context=512)
