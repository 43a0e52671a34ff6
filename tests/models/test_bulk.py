"""The bulk channel (TLS on TCP, node keys) on real sockets on 127.0.0.1, and its sans-IO reply parser."""

from __future__ import annotations

import asyncio
import hashlib
import socket
from pathlib import Path

import pytest
from nacl.signing import SigningKey
from net.net_helpers import endpoint
from test_transfer import PIECE, addr, holder
from tinymodels import write_tiny_llama

from meshllm.errors import DecodeError
from meshllm.identity.ids import node_id
from meshllm.models.bulk import PER_PEER, BulkClient, BulkServer, BulkUnavailable, ReplyParser, Sending
from meshllm.models.library import Library
from meshllm.models.manifest import build_manifest
from meshllm.models.store import ModelStore, Offer
from meshllm.models.transfer import Refused, TransferFailed, Want
from meshllm.net.errors import PeerMismatch
from meshllm.wire.addr import parse_addr
from meshllm.wire.frames import encode_frame

MODEL = "ab" * 32


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("bulk") / "tiny.gguf", n_layers=6, seed=5)


# -- the sans-IO parser -----------------------------------------------------------------------------


def test_parser_takes_a_reply_in_any_fragments() -> None:
    want = Want(model=MODEL, offset=100, length=1000)
    wire = encode_frame(Sending(offset=100, length=1000)) + bytes(range(250)) * 4
    for step in (1, 7, 4096):
        parser = ReplyParser(want)
        for at in range(0, len(wire), step):
            assert not parser.done
            parser.feed(wire[at:at + step])
        assert parser.done and parser.data == bytes(range(250)) * 4 and parser.refused is None


def test_parser_refuses_what_was_not_asked_for() -> None:
    want = Want(model=MODEL, offset=0, length=10)
    refused = ReplyParser(want)
    refused.feed(encode_frame(Refused(message="no such model")))
    assert refused.done and refused.refused == "no such model"
    cases = [
        encode_frame(Sending(offset=5, length=10)),  # another range
        encode_frame(Sending(offset=0, length=10)) + bytes(11),  # bytes past the end
        encode_frame(Refused(message="x")) + b"!",  # bytes after a refusal
        (1 << 20).to_bytes(4, "big"),  # a control frame over the cap
        b"\0\0\0\2\xc1\xc1",  # not msgpack
    ]
    for wire in cases:
        with pytest.raises(DecodeError):
            ReplyParser(want).feed(wire)


# -- real sockets --------------------------------------------------------------------------------------


async def _pair(tmp_path: Path, model: Path, *, corrupt_at: int | None = None, name: str = "h"):  # type: ignore[no-untyped-def]
    key = SigningKey.generate()
    ep = await endpoint(key)
    lib, _ = holder(tmp_path, name, model, corrupt_at=corrupt_at)
    store = ModelStore(lib, ep, key, list, lambda *a, **k: None)
    port = await store.start_bulk("127.0.0.1")
    return key, ep, store, port


def test_stage_fetch_rides_the_bulk_channel(model: Path, tmp_path: Path) -> None:
    manifest = build_manifest(model, piece_size=PIECE)

    async def main() -> None:
        _, hep, hstore, port = await _pair(tmp_path, model)
        wkey = SigningKey.generate()
        wep = await endpoint(wkey)
        worker = ModelStore(Library(tmp_path / "w" / "models"), wep, wkey, list, lambda *a, **k: None,
                            bulk_ports={hep.node_id: port}.get)
        try:
            entry = await worker.stage_file(manifest, "tiny", 1, 4, [(hep.node_id, addr(hep))])
            moved = sum(manifest.spans[i].length for i in (3, 4, 5)) + manifest.spans[0].length
            assert entry.layers == (1, 4)
            assert worker.bulk.received == {hep.node_id: moved} and worker.channels == {hep.node_id: "tcp"}
            assert hstore.bulk_server.sent == {wep.node_id: moved}
        finally:
            await worker.close()
            await hstore.close()
            await wep.close()
            await hep.close()

    asyncio.run(main())


def test_a_listener_with_another_key_is_refused_and_quic_takes_over(model: Path, tmp_path: Path) -> None:
    """The record names a bulk port where another node listens: the dialer refuses it (PeerMismatch)
    and the pieces come over QUIC from the real holder."""
    manifest = build_manifest(model, piece_size=PIECE)

    async def main() -> None:
        _, hep, hstore, _ = await _pair(tmp_path, model, name="h")
        _, oep, ostore, other_port = await _pair(tmp_path, model, name="other")
        wkey = SigningKey.generate()
        wep = await endpoint(wkey)
        worker = ModelStore(Library(tmp_path / "w" / "models"), wep, wkey, list, lambda *a, **k: None,
                            bulk_ports=lambda _node: other_port)
        try:
            with pytest.raises(PeerMismatch, match=hep.node_id):
                await worker.bulk.get_range(hep.node_id, "127.0.0.1", other_port, manifest.model, 0, 16)
            entry = await worker.stage_file(manifest, "tiny", 0, 2, [(hep.node_id, addr(hep))])
            assert entry.layers == (0, 2)
            assert worker.bulk.received == {} and ostore.bulk_server.sent == {}
        finally:
            for closing in (worker, hstore, ostore):
                await closing.close()
            for ep in (wep, hep, oep):
                await ep.close()

    asyncio.run(main())


def test_listener_serves_only_admitted_peers_within_its_limits(model: Path, tmp_path: Path) -> None:
    manifest = build_manifest(model, piece_size=PIECE)

    async def main() -> None:
        key = SigningKey.generate()
        lib, _ = holder(tmp_path, "h", model)
        admitted: set[str] = set()
        server = BulkServer(key, lambda m: (e.file if (e := lib.whole(m)) else None), admitted.__contains__)
        port = await server.start("127.0.0.1")
        holder_id = node_id(bytes(key.verify_key))
        ckey = SigningKey.generate()
        client = BulkClient(ckey)
        try:
            # a stranger (no admitted QUIC connection) gets nothing
            with pytest.raises(BulkUnavailable):
                await client.get_range(holder_id, "127.0.0.1", port, manifest.model, 0, 16)
            admitted.add(node_id(bytes(ckey.verify_key)))
            data = await client.get_range(holder_id, "127.0.0.1", port, manifest.model, 0, 4096)
            assert data == model.read_bytes()[:4096]
            # a range past the end and a model it does not offer are refusals, not hangs
            with pytest.raises(TransferFailed, match="past the model"):
                await client.get_range(holder_id, "127.0.0.1", port, manifest.model, manifest.size - 8, 16)
            with pytest.raises(TransferFailed, match="does not offer"):
                await client.get_range(holder_id, "127.0.0.1", port, MODEL, 0, 16)
            # a peer gets at most PER_PEER connections at once
            client.close()
            conns = []
            for _ in range(PER_PEER + 1):
                reader, writer = await client._connection(holder_id, "127.0.0.1", port)
                conns.append(writer)
                want = Want(model=manifest.model, offset=0, length=8)
                writer.write(encode_frame(want))
                parser = ReplyParser(want)
                while not parser.done and (data := await asyncio.wait_for(reader.read(64), 5.0)):
                    parser.feed(data)
                assert parser.done == (len(conns) <= PER_PEER)
            for writer in conns:
                writer.close()
            # a client that sends garbage is cut off cleanly
            reader, writer = await client._connection(holder_id, "127.0.0.1", port)
            writer.write(b"\xff\xff\xff\xff")
            assert await asyncio.wait_for(reader.read(), 5.0) == b""
            writer.close()
        finally:
            client.close()
            await server.close()

    asyncio.run(main())


def test_a_channel_that_worked_and_then_fails_drops_its_holder(model: Path, tmp_path: Path) -> None:
    """Before the channel to a peer ever worked, a failure may be the path's (the store falls back to
    QUIC); once it has worked, a failure is the peer's: it died or hung, and a QUIC retry of the same
    range would only wait out a stall, so the holder is dropped for the transfer."""
    manifest = build_manifest(model, piece_size=PIECE)

    async def main() -> None:
        key = SigningKey.generate()
        lib, _ = holder(tmp_path, "h", model)
        server = BulkServer(key, lambda m: (e.file if (e := lib.whole(m)) else None), lambda _peer: True)
        port = await server.start("127.0.0.1")
        holder_id = node_id(bytes(key.verify_key))
        client = BulkClient(SigningKey.generate())
        try:
            free = socket.socket()
            free.bind(("127.0.0.1", 0))
            closed_port = free.getsockname()[1]
            free.close()
            with pytest.raises(BulkUnavailable):  # never worked: maybe the path (QUIC takes over)
                await client.get_range(holder_id, "127.0.0.1", closed_port, manifest.model, 0, 16)
            assert await client.get_range(holder_id, "127.0.0.1", port, manifest.model, 0, 16)
            client.close()  # no pooled connection left, and the holder is gone
            await server.close()
            with pytest.raises(TransferFailed, match="stopped answering"):
                await client.get_range(holder_id, "127.0.0.1", port, manifest.model, 0, 16)
        finally:
            client.close()
            await server.close()

    asyncio.run(main())


def test_a_corrupt_piece_names_its_source(model: Path, tmp_path: Path) -> None:
    manifest = build_manifest(model, piece_size=PIECE)

    async def main() -> None:
        _, bep, bstore, bport = await _pair(tmp_path, model, corrupt_at=manifest.spans[4].offset + 100, name="bad")
        _, gep, gstore, gport = await _pair(tmp_path, model, name="good")
        wkey = SigningKey.generate()
        wep = await endpoint(wkey)
        events: list[tuple[str, dict]] = []
        ports = {bep.node_id: bport, gep.node_id: gport}
        worker = ModelStore(Library(tmp_path / "w" / "models"), wep, wkey,
                            lambda: [Offer(gep.node_id, addr(gep), manifest.model, "tiny", 1)],
                            lambda t, **f: events.append((t, f)), bulk_ports=ports.get)
        try:
            entry = await worker.stage_file(manifest, "tiny", 2, 4, [(bep.node_id, addr(bep))])
            assert hashlib.sha256(entry.file.read_bytes()).digest()  # written, and every piece verified
            (dropped,) = [f for t, f in events if t == "transfer_holder_dropped"]
            assert dropped["holder"] == bep.node_id and dropped["bad_bytes"] and "sha256" in dropped["reason"]
            assert worker.bulk.received[gep.node_id] > 0 and worker.bulk.received[bep.node_id] > 0
        finally:
            for closing in (worker, bstore, gstore):
                await closing.close()
            for ep in (wep, bep, gep):
                await ep.close()

    asyncio.run(main())


def test_a_dead_bulk_port_falls_back_to_quic(model: Path, tmp_path: Path) -> None:
    manifest = build_manifest(model, piece_size=PIECE)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]

    async def main() -> None:
        _, hep, hstore, _ = await _pair(tmp_path, model)
        wkey = SigningKey.generate()
        wep = await endpoint(wkey)
        events: list[tuple[str, dict]] = []
        worker = ModelStore(Library(tmp_path / "w" / "models"), wep, wkey, list, lambda t, **f: events.append((t, f)),
                            bulk_ports=lambda _node: dead)
        try:
            entry = await worker.stage_file(manifest, "tiny", 0, 6, [(hep.node_id, addr(hep))])
            assert entry.layers == (0, 6) and worker.bulk.received == {}
            assert worker.channels == {hep.node_id: "quic"}
            (fallback,) = [f for t, f in events if t == "transfer_channel_fallback"]
            assert fallback["holder"] == hep.node_id and "cannot reach" in fallback["reason"]
        finally:
            await worker.close()
            await hstore.close()
            await wep.close()
            await hep.close()

    asyncio.run(main())


def test_a_path_that_is_not_direct_rides_quic(model: Path, tmp_path: Path) -> None:
    """The bulk port is dialled only where the QUIC path to the holder is direct: over a punched (or
    relayed) path the TCP port is likely unreachable or not the holder's, so pieces stay on QUIC."""
    manifest = build_manifest(model, piece_size=PIECE)

    async def main() -> None:
        _, hep, hstore, port = await _pair(tmp_path, model)
        wkey = SigningKey.generate()
        wep = await endpoint(wkey)
        worker = ModelStore(Library(tmp_path / "w" / "models"), wep, wkey, list, lambda *a, **k: None,
                            bulk_ports={hep.node_id: port}.get)
        try:
            conn = await wep.connect(parse_addr(addr(hep)), hep.node_id)
            conn.path = "punched"  # as traversal marks a connection that came through a hole punch
            entry = await worker.stage_file(manifest, "tiny", 0, 3, [(hep.node_id, addr(hep))])
            assert entry.layers == (0, 3) and worker.bulk.received == {} and worker.channels == {hep.node_id: "quic"}
            assert hstore.bulk_server.sent == {}
        finally:
            await worker.close()
            await hstore.close()
            await wep.close()
            await hep.close()

    asyncio.run(main())
