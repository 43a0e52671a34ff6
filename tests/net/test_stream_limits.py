"""Bounded receiving over real UDP: large frames by reservation, whole-frame deadlines, cool-downs."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from net_helpers import endpoint, until

from meshllm.net import ConnectError, Stream, StreamClosed
from meshllm.net import streams as streams_module
from meshllm.wire.frames import HEADER

WINDOW = 64 * 1024


class Blob(msgspec.Struct):
    data: bytes


def write_raw(stream: Stream, data: bytes) -> None:
    stream.peer.stream_op(lambda q: q.send_stream_data(stream.id, data))


def held(ep, peer_id: str) -> int:  # type: ignore[no-untyped-def]
    """Every byte the connection to ``peer_id`` buffers in its streams."""
    return sum(s.buffered for s in ep.peers[peer_id]._streams.values())


def test_unread_large_frames_stay_charged_to_the_frame_budget() -> None:
    """A peer that never reads large frames gets no more of them than the budget holds."""
    budget = 4 * WINDOW

    async def main() -> None:
        async def never_reads(stream, peer) -> None:  # type: ignore[no-untyped-def]
            await asyncio.sleep(30)

        a = await endpoint(stream_window=WINDOW)
        b = await endpoint(stream_window=WINDOW, frame_budget=budget, connection_window=4 * WINDOW)
        b.on_stream("sink", never_reads, max_frame=budget)
        peer = await a.connect(b.local_addr)
        for _ in range(20):
            stream = await peer.open_stream("sink", max_frame=budget)
            await stream.send(Blob(b"L" * (WINDOW - 64)), timeout=5)
        await asyncio.sleep(1.0)
        assert held(b, a.node_id) <= budget + 4 * WINDOW + WINDOW
        await a.close()
        await b.close()

    asyncio.run(main())


def test_large_frames_on_many_streams_all_arrive_one_reservation_at_a_time() -> None:
    """Frames of three windows each, on four streams at once, with room reserved for one: no deadlock."""
    size, budget = 3 * WINDOW, 4 * WINDOW

    async def main() -> None:
        got: list[int] = []
        reading = asyncio.Event()

        async def sink(stream, peer) -> None:  # type: ignore[no-untyped-def]
            await reading.wait()
            while (m := await stream.recv(Blob, timeout=10)) is not None:
                got.append(len(m.data))

        a = await endpoint(stream_window=WINDOW)
        b = await endpoint(stream_window=WINDOW, frame_budget=budget, connection_window=8 * WINDOW)
        b.on_stream("sink", sink, max_frame=4 * WINDOW)
        peer = await a.connect(b.local_addr)
        outs = [await peer.open_stream("sink", max_frame=4 * WINDOW) for _ in range(4)]
        for stream in outs:
            await stream.send(Blob(b"x" * size), timeout=10)
            await stream.send(Blob(b"y" * size), timeout=10)
            stream.close()
        await asyncio.sleep(0.5)
        assert held(b, a.node_id) <= budget + 8 * WINDOW  # bounded while nobody reads
        reading.set()
        await until(lambda: len(got) == 8, 10.0)
        assert set(got) == {size}
        await a.close()
        await b.close()

    asyncio.run(main())


def test_unfinished_frames_are_bounded_and_released_when_their_streams_go() -> None:
    budget, conn_window = 8 * WINDOW, 16 * WINDOW

    async def main() -> None:
        async def sink(stream, peer) -> None:  # type: ignore[no-untyped-def]
            await stream.recv(Blob, timeout=30)

        a = await endpoint(stream_window=WINDOW)
        b = await endpoint(stream_window=WINDOW, frame_budget=budget, connection_window=conn_window)
        b.on_stream("sink", sink, max_frame=budget)
        peer = await a.connect(b.local_addr)
        outs = []
        for _ in range(20):
            stream = await peer.open_stream("sink")
            write_raw(stream, HEADER.pack(budget - HEADER.size) + b"z" * (budget - 2 * HEADER.size))  # never ends
            outs.append(stream)
        await asyncio.sleep(1.0)
        # One frame holds the whole budget; the others wait at a window each, all within the connection window.
        assert held(b, a.node_id) <= budget + conn_window + WINDOW
        assert sum(s.reserved for s in b.peers[a.node_id]._streams.values()) <= budget
        for stream in outs:
            stream.reset()
        await until(lambda: held(b, a.node_id) == 0 and b.frames.used == 0)
        await a.close()
        await b.close()

    asyncio.run(main())


def test_a_connection_holds_at_most_its_window_of_unread_frames() -> None:
    conn_window = 4 * WINDOW

    async def main() -> None:
        async def never_reads(stream, peer) -> None:  # type: ignore[no-untyped-def]
            await asyncio.sleep(30)

        a = await endpoint(stream_window=WINDOW)
        b = await endpoint(stream_window=WINDOW, connection_window=conn_window)
        b.on_stream("sink", never_reads)
        peer = await a.connect(b.local_addr)
        for _ in range(30):  # 30 streams of a window each (small frames): 7.5 connection windows
            stream = await peer.open_stream("sink")
            for _ in range(4):
                await stream.send(Blob(b"q" * (WINDOW // 4 - 64)), timeout=5)
        await asyncio.sleep(1.0)
        assert held(b, a.node_id) <= conn_window + 2 * WINDOW
        await a.close()
        await b.close()

    asyncio.run(main())


def test_a_dripped_frame_is_reset_at_its_deadline_and_repeat_offenders_cool_down(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams_module, "FRAME_DEADLINE_S", 0.5)

    async def main() -> None:
        async def sink(stream, peer) -> None:  # type: ignore[no-untyped-def]
            await stream.recv(Blob, timeout=None)  # no deadline of its own: the transport's holds

        a, b = await endpoint(), await endpoint()
        b.on_stream("sink", sink)
        peer = await a.connect(b.local_addr)
        cooled: list[str] = []
        b.on_cool_down = lambda node, reason: cooled.append(node)
        for n in range(3):
            stream = await peer.open_stream("sink")
            write_raw(stream, HEADER.pack(100))
            for _ in range(30):  # a byte every 0.1 s: each wake-up comes well inside any per-read timeout
                if n < 2 and stream.finished:
                    break
                write_raw(stream, b"\x00")
                await asyncio.sleep(0.1)
            if n < 2:
                with pytest.raises(StreamClosed, match="0x15"):
                    await stream.recv(Blob, timeout=1)
        await until(lambda: cooled == [a.node_id])
        await until(lambda: a.node_id not in b.peers)
        assert b.cooling(a.node_id) > 0
        with pytest.raises(ConnectError):  # refused at the handshake while cooling down
            await a.connect(b.local_addr, timeout=2)
        with pytest.raises(ConnectError, match="cooling down"):
            await b.connect(a.local_addr, expected_node_id=a.node_id, timeout=2)
        assert peer.close_reason is not None and "cooling down" in peer.close_reason
        await a.close()
        await b.close()

    asyncio.run(main())


def test_recv_timeout_bounds_the_whole_call_despite_a_trickle() -> None:
    async def main() -> None:
        result: list[str] = []

        async def sink(stream, peer) -> None:  # type: ignore[no-untyped-def]
            start = asyncio.get_running_loop().time()
            try:
                await stream.recv(Blob, timeout=0.5)
            except Exception as exc:
                result.append(f"{type(exc).__name__} after {asyncio.get_running_loop().time() - start:.1f}")

        a, b = await endpoint(), await endpoint()
        b.on_stream("sink", sink)
        peer = await a.connect(b.local_addr)
        stream = await peer.open_stream("sink")
        write_raw(stream, HEADER.pack(100))
        for _ in range(15):
            if result:
                break
            write_raw(stream, b"\x00")
            await asyncio.sleep(0.1)
        assert result and result[0].startswith("NetTimeout after 0.")
        await a.close()
        await b.close()

    asyncio.run(main())


def test_a_finished_handler_stops_reading_and_its_stream_is_forgotten() -> None:
    async def main() -> None:
        async def reads_one(stream, peer) -> None:  # type: ignore[no-untyped-def]
            await stream.recv(Blob, timeout=5)

        a, b = await endpoint(stream_window=WINDOW), await endpoint(stream_window=WINDOW)
        b.on_stream("one", reads_one)
        peer = await a.connect(b.local_addr)
        stream = await peer.open_stream("one")
        await stream.send(Blob(b"first"), timeout=5)
        await until(lambda: not b.peers[a.node_id]._streams)  # forgotten although we never sent FIN
        with pytest.raises(StreamClosed, match="stopped by peer"):
            for _ in range(100):
                await stream.send(Blob(b"more" * 1000), timeout=5)
                await asyncio.sleep(0.01)
        await a.close()
        await b.close()

    asyncio.run(main())
