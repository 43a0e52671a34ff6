"""Peer streams whose first data arrives out of order (a lost packet) are still served."""

from __future__ import annotations

import asyncio

from net_helpers import Msg, endpoint, until

from meshllm.net import PeerConnection, Stream
from meshllm.net.messages import StreamOpen
from meshllm.wire.frames import encode_frame


def test_a_lower_peer_stream_arriving_after_a_higher_one_is_dispatched() -> None:
    async def main() -> None:
        got: list[tuple[int, str]] = []

        async def record(stream: Stream, _peer: PeerConnection) -> None:
            msg = await stream.recv(Msg, timeout=2)
            assert msg is not None
            got.append((stream.id, msg.text))

        a, b = await endpoint(), await endpoint()
        b.on_stream("rec", record)
        await a.connect(b.local_addr)
        await until(lambda: a.node_id in b.peers and b.peers[a.node_id].admitted)
        conn = b.peers[a.node_id]  # b accepted: the dialer's streams are 0 (admission), 4, 8, ...

        def deliver(stream_id: int, text: str) -> None:
            data = encode_frame(StreamOpen("rec")) + encode_frame(Msg(text))
            conn._on_stream_data(stream_id, data, True)

        deliver(12, "third")  # streams 4 and 8 lost their first packets ...
        deliver(4, "first")  # ... which then arrive late, in any order
        deliver(8, "second")
        await until(lambda: len(got) == 3)
        assert sorted(got) == [(4, "first"), (8, "second"), (12, "third")]
        await until(lambda: not conn._streams)

        deliver(8, "again")  # a stream we finished and forgot is not reopened
        deliver(0, "admission again")
        deliver(16, "fourth")  # a barrier: a new stream after them is handled after them
        await until(lambda: (16, "fourth") in got)
        await until(lambda: not conn._streams)
        assert sorted(got) == [(4, "first"), (8, "second"), (12, "third"), (16, "fourth")]
        await a.close()
        await b.close()

    asyncio.run(main())
