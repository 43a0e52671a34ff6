"""Typed streams over real UDP: dispatch by kind, multiplexing, backpressure, bad frames."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from net_helpers import Msg, endpoint, until

from meshllm.net import StreamClosed
from meshllm.wire.frames import HEADER


class Blob(msgspec.Struct):
    data: bytes


async def upper(stream, peer) -> None:  # type: ignore[no-untyped-def]
    while (m := await stream.recv(Msg, timeout=5)) is not None:
        await stream.send(Msg(f"{stream.kind}:{m.text.upper()}"))


def test_many_streams_of_several_kinds_are_multiplexed() -> None:
    async def main() -> None:
        a, b = await endpoint(), await endpoint()
        for kind in ("gossip", "tunnel", "lane"):
            b.on_stream(kind, upper)
        peer = await a.connect(b.local_addr)

        async def talk(i: int) -> str:
            stream = await peer.open_stream(("gossip", "tunnel", "lane")[i % 3])
            replies = []
            for j in range(3):
                await stream.send(Msg(f"m{i}.{j}"))
                replies.append((await stream.recv(Msg, timeout=5)).text)  # type: ignore[union-attr]
            stream.close()
            assert await stream.recv(Msg, timeout=5) is None
            return ",".join(replies)

        results = await asyncio.gather(*(talk(i) for i in range(60)))
        for i, text in enumerate(results):
            kind = ("gossip", "tunnel", "lane")[i % 3]
            assert text == ",".join(f"{kind}:M{i}.{j}" for j in range(3))
        await until(lambda: not peer._streams and not b.peers[a.node_id]._streams)  # all forgotten
        await a.close()
        await b.close()

    asyncio.run(main())


def test_unknown_kind_resets_the_stream() -> None:
    async def main() -> None:
        a, b = await endpoint(), await endpoint()
        peer = await a.connect(b.local_addr)
        stream = await peer.open_stream("no-such-kind")
        await stream.send(Msg("x"))
        with pytest.raises(StreamClosed, match="reset by peer"):
            await stream.recv(Msg, timeout=2)
        await a.close()
        await b.close()

    asyncio.run(main())


def test_a_starting_endpoint_holds_a_stream_until_its_kind_is_served() -> None:
    """While a node starts, its services register their stream kinds after its peers heard of it: a stream
    of a kind not served yet waits for its handler (its bytes, sent before, are read then); one never
    served is refused once the node has started, or when ``startup_wait_s`` runs out."""
    async def main() -> None:
        a, b, c = await endpoint(), await endpoint(startup_wait_s=30.0), await endpoint(startup_wait_s=0.5)
        peer = await a.connect(b.local_addr)
        early = await peer.open_stream("late")
        await early.send(Msg("sent before the handler"))
        never = await peer.open_stream("never")
        await never.send(Msg("x"))
        await asyncio.sleep(0.3)
        b.on_stream("late", upper)
        assert (await early.recv(Msg, timeout=3)).text == "late:SENT BEFORE THE HANDLER"  # type: ignore[union-attr]
        assert not never.finished  # still held
        b.started()  # (well before its 30 s wait ends)
        with pytest.raises(StreamClosed, match="reset by peer"):
            await never.recv(Msg, timeout=3)
        after = await peer.open_stream("never")
        await after.send(Msg("x"))
        with pytest.raises(StreamClosed, match="reset by peer"):
            await after.recv(Msg, timeout=3)
        waited = await (await a.connect(c.local_addr)).open_stream("never")  # c never says it started
        await waited.send(Msg("x"))
        with pytest.raises(StreamClosed, match="reset by peer"):
            await waited.recv(Msg, timeout=3)
        for e in (a, b, c):
            await e.close()

    asyncio.run(main())


def test_slow_reader_bounds_the_senders_queue() -> None:
    window, budget, size = 64 * 1024, 32 * 1024, 8 * 1024

    async def main() -> None:
        reading = asyncio.Event()
        got: list[int] = []

        async def slow(stream, peer) -> None:  # type: ignore[no-untyped-def]
            await reading.wait()
            while (m := await stream.recv(Blob, timeout=5)) is not None:
                got.append(len(m.data))

        a = await endpoint(stream_window=window, send_budget=budget)
        b = await endpoint(stream_window=window, send_budget=budget)
        b.on_stream("sink", slow)
        peer = await a.connect(b.local_addr)
        stream = await peer.open_stream("sink")
        sent = 0
        peak = 0

        async def writer() -> None:
            nonlocal sent, peak
            for _ in range(200):  # 1.6 MB, far beyond window + budget
                await stream.send(Blob(b"z" * size))
                sent += size
                peak = max(peak, stream.queued)
            stream.close()

        task = asyncio.create_task(writer())
        await asyncio.sleep(0.3)  # the writer runs into the reader's window and stalls
        assert not task.done()
        assert sent <= window + budget + 2 * size
        inbound = b.peers[a.node_id]._streams[stream.id].buffered
        assert inbound <= window + size + HEADER.size + 16  # the window plus at most one partial frame
        reading.set()
        await asyncio.wait_for(task, 10)
        await until(lambda: sum(got) == 200 * size, timeout=10)
        assert peak <= budget + size + HEADER.size + 16
        await a.close()
        await b.close()

    asyncio.run(main())


def test_malformed_and_oversized_frames_reset_only_that_stream() -> None:
    async def main() -> None:
        a, b = await endpoint(), await endpoint()
        b.on_stream("echo", upper)
        b.on_stream("small", upper, max_frame=64)
        peer = await a.connect(b.local_addr)

        bad = await peer.open_stream("echo")
        bad._write(HEADER.pack(3) + b"\xc1\xc1\xc1")  # 0xc1 is never valid msgpack
        with pytest.raises(StreamClosed):
            await bad.recv(Msg, timeout=2)

        big = await peer.open_stream("small")
        await big.send(Msg("x" * 200))
        with pytest.raises(StreamClosed):
            await big.recv(Msg, timeout=2)

        wrong = await peer.open_stream("echo")
        await wrong.send({"not": "a Msg"})
        with pytest.raises(StreamClosed):
            await wrong.recv(Msg, timeout=2)

        good = await peer.open_stream("echo")  # the connection survived all three
        await good.send(Msg("still here"))
        assert (await good.recv(Msg, timeout=2)) == Msg("echo:STILL HERE")
        assert peer.state == "alive"
        await a.close()
        await b.close()

    asyncio.run(main())


def test_recv_type_mismatch_resets_locally_and_recv_times_out() -> None:
    async def main() -> None:
        a, b = await endpoint(), await endpoint()

        async def send_int(stream, peer) -> None:  # type: ignore[no-untyped-def]
            await stream.recv(Msg, timeout=5)
            await stream.send(42)
            await asyncio.sleep(1)

        b.on_stream("int", send_int)
        peer = await a.connect(b.local_addr)
        stream = await peer.open_stream("int")
        with pytest.raises(TimeoutError):
            await stream.recv(Msg, timeout=0.05)
        await stream.send(Msg("go"))
        with pytest.raises(StreamClosed, match="not a valid Msg"):
            await stream.recv(Msg, timeout=2)
        with pytest.raises(StreamClosed):
            await stream.send(Msg("after reset"))
        await a.close()
        await b.close()

    asyncio.run(main())


def test_connection_close_fails_pending_recv() -> None:
    async def main() -> None:
        a, b = await endpoint(), await endpoint()
        b.on_stream("hang", lambda stream, peer: asyncio.sleep(5))
        peer = await a.connect(b.local_addr)
        stream = await peer.open_stream("hang")
        pending = asyncio.create_task(stream.recv(Msg, timeout=5))
        await until(lambda: a.node_id in b.peers and bool(b.peers[a.node_id]._streams))  # b runs the handler
        assert not pending.done()
        await b.close()
        with pytest.raises(StreamClosed, match="endpoint closing"):
            await asyncio.wait_for(pending, 2)
        await a.close()

    asyncio.run(main())


def test_frame_larger_than_the_stream_window_arrives() -> None:
    window = 128 * 1024
    big = window + 1024 * 1024
    max_frame = 2 * big

    async def main() -> None:
        reading = asyncio.Event()
        got: list[int] = []

        async def sink(stream, peer) -> None:  # type: ignore[no-untyped-def]
            await reading.wait()
            while (m := await stream.recv(Blob, timeout=5)) is not None:
                got.append(len(m.data))
            await stream.send(Msg(f"{len(got)}"))

        a = await endpoint(stream_window=window)
        b = await endpoint(stream_window=window)
        b.on_stream("lane", sink, max_frame=max_frame)
        peer = await a.connect(b.local_addr)
        stream = await peer.open_stream("lane", max_frame=max_frame)

        async def writer() -> None:
            for _ in range(4):
                await stream.send(Blob(b"q" * big), timeout=10)
            stream.close()

        task = asyncio.create_task(writer())
        await asyncio.sleep(0.5)  # nobody reads yet: the sender is still bounded
        inbound = b.peers[a.node_id]._streams[stream.id].buffered
        assert inbound <= max_frame + window
        assert inbound < 4 * big
        reading.set()
        await asyncio.wait_for(task, 10)
        assert (await stream.recv(Msg, timeout=10)) == Msg("4")
        assert got == [big] * 4
        await a.close()
        await b.close()

    asyncio.run(main())
