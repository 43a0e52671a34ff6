"""A hostile mesh member for the security tests, built from the project's own modules.

The attacker joins for real: it is a :class:`~meshllm.mesh.service.MeshService` admitted with a
genuine invite (the token a running owner printed), so everything it sends arrives over an admitted
QUIC connection, exactly as a compromised member's traffic would. On top of that it crafts what an
honest node never sends: forged or replayed gossip, raw bytes on streams, frames that never end,
streams it never reads. The victims are real nodes started through the CLI (``tests/nodes.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
from msgspec import msgpack
from nacl.signing import SigningKey

from meshllm.errors import MeshllmError
from meshllm.identity.ids import node_id as node_id_of
from meshllm.identity.keys import NodeKey
from meshllm.identity.signing import Signed, decode_signed, sign
from meshllm.mesh.admission import INVITE_DOMAIN, inspect_token, make_grant, verify_invite, with_grant
from meshllm.mesh.membership import join_mesh
from meshllm.mesh.messages import Digest, DownNotice, MeshMessage, Notices, sign_notice
from meshllm.mesh.records import RECORD_DOMAIN, SEQ_LIMIT, Models, PeerRecord, ServedModel, sign_record
from meshllm.mesh.service import GOSSIP_STREAM, MeshService
from meshllm.net import EndpointOptions, PeerConnection, Stream
from meshllm.runtime.tunnel import STREAM_KIND as TUNNEL_KIND
from meshllm.runtime.tunnel import CallerFrame, RequestFrame
from meshllm.split.frames import KIND as LANE_KIND
from meshllm.wire.addr import parse_addr
from meshllm.wire.frames import HEADER, encode_frame

Answer = Callable[[RequestFrame, Stream], Awaitable[None]]
"""How a hostile member answers one routed request: it writes what it likes on the tunnel stream."""


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MB (from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class Attacker:
    """One hostile member: a real mesh service plus helpers that send what honest code never would."""

    def __init__(self, token: str, name: str = "mallory", key: SigningKey | None = None, padding: int = 0,
                 window: int | None = None, bootstrap: list[str] | None = None, joined: float | None = None,
                 serves: tuple[str, ...] = ()) -> None:
        """``padding`` bytes of model names inflate our record towards the 64 KiB cap; ``window``
        shrinks the stream credit we grant (a peer that barely reads); ``bootstrap`` replaces the
        invite's addresses (join through another member); ``joined`` backdates our proof; ``serves``
        announces models we claim to serve (answer their requests with :meth:`answer_requests`)."""
        self.key = NodeKey(key or SigningKey.generate())
        self.events: list[tuple[str, dict[str, Any]]] = []
        membership = join_mesh(self.key.signing_key, token, time.time() if joined is None else joined)
        if bootstrap is not None:
            membership.bootstrap = bootstrap
        models = Models(available=[f"m{i:05d}" + "x" * 58 for i in range(padding // 64)],
                        served=[ServedModel(name=name, context=2048) for name in serves])
        record = PeerRecord(node_id=self.key.node_id, mesh_id=membership.mesh_id, seq=0,
                            membership_proof=membership.proof, name=name, role="client", models=models)
        self.service = MeshService(
            self.key, membership, record, check_trust=lambda *_: None,
            on_event=lambda kind, **fields: self.events.append((kind, fields)), host="127.0.0.1",
            rng=random.Random(os.urandom(8)),
            endpoint_options=None if window is None else EndpointOptions(stream_window=window),
        )

    @property
    def node_id(self) -> str:
        return self.key.node_id

    async def start(self) -> None:
        await self.service.start()

    async def stop(self) -> None:
        await self.service.stop(graceful=False)

    async def connect(self, mesh_addr: str, node_id: str | None = None, timeout: float = 5.0) -> PeerConnection:
        """An admitted connection to the node at ``mesh_addr`` (reused if the service holds one)."""
        assert self.service.endpoint is not None
        return await self.service.endpoint.connect(parse_addr(mesh_addr), expected_node_id=node_id, timeout=timeout)

    def stop_reading_gossip(self) -> None:
        """From now on, gossip streams the victims open to us are accepted and never read."""
        assert self.service.endpoint is not None

        async def never_read(stream: Stream, conn: PeerConnection) -> None:
            await asyncio.sleep(3600)

        self.service.endpoint.on_stream(GOSSIP_STREAM, never_read)

    def answer_requests(self, answer: Answer) -> None:
        """Routed requests (``request`` streams) are answered by ``answer(request, stream)``, which
        writes whatever frames it likes; ``self.requests`` counts them."""
        assert self.service.endpoint is not None
        self.requests = 0

        async def serve(stream: Stream, conn: PeerConnection) -> None:
            frame = await stream.recv(CallerFrame, timeout=5.0)
            if isinstance(frame, RequestFrame):
                self.requests += 1
                with contextlib.suppress(MeshllmError):
                    await answer(frame, stream)

        self.service.endpoint.on_stream(TUNNEL_KIND, serve)

    @property
    def mesh_addr(self) -> str:
        return self.service.listen_addrs()[0]

    def admit_anyone(self) -> None:
        """Tamper with our own admission: any invite, live or not, used up or not, lets a node in."""
        self.service.admission.check_invite = lambda signed, now, joiner=None: verify_invite(signed)  # type: ignore[method-assign]

    def own_record(self) -> bytes:
        """Our current signed record, as the victims would receive it."""
        assert self.service.gossip is not None
        return self.service.gossip.own_raw

    def forge_member(self, token: str, name: str) -> bytes:
        """The signed record of a fresh node id that we "admitted" ourselves, as any member can.

        Its credential is genuine as far as it goes: a proof on ``token`` and our own grant, dated
        now. What members do with such nodes is the point (attributable to us, bounded, revocable).
        """
        key = SigningKey.generate()
        nid = node_id_of(bytes(key.verify_key))
        now = time.time()
        membership = join_mesh(key, token, now)
        grant = make_grant(self.key.signing_key, self.service.membership.proof, membership.mesh_id, nid,
                           inspect_token(token).invite_id, now)
        record = {"node_id": nid, "mesh_id": membership.mesh_id, "seq": int(now * 1000),
                  "membership_proof": with_grant(membership.proof, grant), "name": name, "role": "client",
                  "signed_at": now}
        return msgpack.encode(sign(key, RECORD_DOMAIN, record))

    async def send_gossip(self, conn: PeerConnection, message: MeshMessage) -> None:
        """One gossip message on a stream of its own, as the protocol wants it."""
        stream = await conn.open_stream(GOSSIP_STREAM)
        await stream.send(message, timeout=5.0)
        stream.close()


class Vouched:
    """A node identity a hostile member made and admitted itself (its grant), whose record it re-signs at will."""

    def __init__(self, member: Attacker, token: str, name: str) -> None:
        self.key = SigningKey.generate()
        self.node_id = node_id_of(bytes(self.key.verify_key))
        self.name = name
        now = time.time()
        membership = join_mesh(self.key, token, now)
        self.mesh_id = membership.mesh_id
        grant = make_grant(member.key.signing_key, member.service.membership.proof, membership.mesh_id,
                           self.node_id, inspect_token(token).invite_id, now)
        self.credential = with_grant(membership.proof, grant)
        self.seq = int(now * 1000)

    def record(self, padding: int = 0) -> bytes:
        """A newly signed record (the next sequence, signed now), its name padded to ``padding`` bytes."""
        self.seq += 1
        record = PeerRecord(node_id=self.node_id, mesh_id=self.mesh_id, seq=self.seq,
                            membership_proof=self.credential, name=self.name + "x" * padding, role="client",
                            signed_at=time.time())
        return sign_record(self.key, record)


def invites_in(data: bytes) -> list[Signed]:
    """Every signed invite anywhere inside ``data`` (msgpack, however deeply nested in bytes)."""
    found: list[Signed] = []

    def walk(value: object) -> None:
        if isinstance(value, bytes):
            try:
                signed = decode_signed(value, "x")
            except MeshllmError:
                signed = None
            if signed is not None and signed.domain == INVITE_DOMAIN:
                found.append(signed)
            with contextlib.suppress(msgspec.DecodeError, ValueError, TypeError):
                walk(msgpack.decode(value))
        elif isinstance(value, list | tuple):
            if len(value) == 4 and value[0] == INVITE_DOMAIN and all(isinstance(v, bytes) for v in value[1:]):
                found.append(Signed(*value))  # an invite embedded as a struct, not as bytes
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)

    walk(data)
    return found


def write_raw(stream: Stream, data: bytes) -> None:
    """Put raw bytes on a stream, bypassing the framing an honest sender uses."""
    stream.peer.stream_op(lambda q: q.send_stream_data(stream.id, data))


def frame(message: Any, max_size: int = 64 * 1024 * 1024) -> bytes:
    """A well-formed frame (length prefix and msgpack body) of ``message``."""
    return encode_frame(message, max_size)


def garbage_initial(dcid: bytes | None = None) -> bytes:
    """A 1,200-byte datagram that parses as a QUIC v1 Initial and decrypts to nothing."""
    dcid = dcid or os.urandom(8)
    scid = os.urandom(8)
    header = bytes([0xC0]) + (1).to_bytes(4, "big") + bytes([len(dcid)]) + dcid + bytes([len(scid)]) + scid
    header += b"\x00"  # token length 0
    body_len = 1200 - len(header) - 2
    header += (0x4000 | body_len).to_bytes(2, "big")
    return header + os.urandom(body_len)


class InitialFlood:
    """Sends garbage QUIC Initials at about ``rate`` a second from one UDP socket, in a thread."""

    def __init__(self, target: str, rate: float) -> None:
        self.addr = parse_addr(target)
        self.rate = rate
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> InitialFlood:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        batch = max(1, int(self.rate / 50))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            while not self._stop.wait(batch / self.rate):
                for _ in range(batch):
                    sock.sendto(garbage_initial(), self.addr)
                    self.sent += 1


class EdgeAbuse:
    """Abuses a node's local HTTP API from a thread: ``half_open`` connections that send a request line
    and one header, then nothing (slowloris), topped up as the node closes them; a body dripped a byte
    a second; and, in turn, management calls without the admin token, a foreign ``Host`` header (DNS
    rebinding), bad JSON and a body over the cap. ``statuses`` counts what each kind got (0: no answer)."""

    PARTIAL = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "

    def __init__(self, api: str, model: str, half_open: int = 300, body_cap: int = 4 * 1024 * 1024) -> None:
        self.api = api
        host, port = api.removeprefix("http://").rsplit(":", 1)
        self.addr = (host, int(port))
        self.model = model
        self.half_open = half_open
        self.body_cap = body_cap
        self.opened = 0
        self.statuses: dict[str, dict[int, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> EdgeAbuse:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        held: list[socket.socket] = []
        drip = socket.create_connection(self.addr, timeout=5)
        drip.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json"
                     b"\r\ncontent-length: 100000\r\n\r\n")
        calls = self._calls()
        with httpx.Client(base_url=self.api, timeout=10) as client:
            try:
                for turn in range(1_000_000):
                    if self._stop.wait(0.1):
                        break
                    held = [s for s in held if not _closed(s)]
                    for _ in range(min(20, self.half_open - len(held))):
                        with contextlib.suppress(OSError):
                            sock = socket.create_connection(self.addr, timeout=5)
                            sock.sendall(self.PARTIAL)
                            held.append(sock)
                            self.opened += 1
                    with contextlib.suppress(OSError):
                        drip.send(b"{")
                    kind, (method, path, headers, body) = calls[turn % len(calls)]
                    try:
                        status = client.request(method, path, headers=headers, content=body).status_code
                    except httpx.HTTPError:
                        status = 0
                    counts = self.statuses.setdefault(kind, {})
                    counts[status] = counts.get(status, 0) + 1
            finally:
                for sock in [*held, drip]:
                    sock.close()

    def _calls(self) -> list[tuple[str, tuple[str, str, dict[str, str], bytes]]]:
        json_type = {"content-type": "application/json"}
        chat = msgspec.json.encode({"model": self.model, "max_tokens": 1,
                                    "messages": [{"role": "user", "content": "x" * (self.body_cap + 1024)}]})
        return [
            ("management_without_token", ("POST", "/api/invite", json_type, b'{"ttl_s": 86400, "max_uses": 0}')),
            ("management_without_token", ("POST", "/api/publish", json_type, b'{"name": "stolen"}')),
            ("foreign_host", ("GET", "/v1/models", {"host": "rebind.attacker.test"}, b"")),
            ("bad_json", ("POST", "/v1/chat/completions", json_type, b'{"model": ')),
            ("over_the_cap", ("POST", "/v1/chat/completions", json_type, chat)),
        ]


def _closed(sock: socket.socket) -> bool:
    """Whether the node is done with ``sock``: closed it, or answered (a 408) and will."""
    sock.setblocking(False)
    try:
        sock.recv(65536)
        return True  # an answer (a held request is never complete) or the end of the stream
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


# -- attack routines (shared by the single-finding tests' campaign and the soak) ----------------

FRAME_31M = 31 * 1024 * 1024


async def flood_digests(mallory: Attacker, conn: PeerConnection, until: float, loops: int = 4) -> None:
    """Empty digests, as fast as we can send them, while reading none of the answers."""
    mallory.stop_reading_gossip()

    async def loop() -> None:
        while time.monotonic() < until and conn.close_reason is None:
            with contextlib.suppress(MeshllmError):
                stream = await conn.open_stream(GOSSIP_STREAM)
                for _ in range(50):
                    await stream.send(Digest({}), timeout=1.0)
                stream.close()
            await asyncio.sleep(0)

    await asyncio.gather(*(loop() for _ in range(loops)))


async def unfinished_lane_frames(conn: PeerConnection, streams: int = 20, size: int = FRAME_31M) -> list[Stream]:
    """``streams`` stage-lane streams, each announcing a ``size`` frame and sending all but 1 MiB of it."""
    chunk = b"\x00" * (1024 * 1024)
    out = []
    for _ in range(streams):
        stream = await conn.open_stream(LANE_KIND)
        write_raw(stream, HEADER.pack(size - HEADER.size))
        for _ in range(size // len(chunk) - 1):
            write_raw(stream, chunk)
        out.append(stream)
    return out


async def drip(stream: Stream, seconds: float) -> float | None:
    """Announce a 100-byte frame and send it a byte a second; when the peer reset it, or None."""
    start = time.monotonic()
    write_raw(stream, HEADER.pack(100))
    while time.monotonic() - start < seconds:
        try:
            await stream.recv(bytes, timeout=1.0)
            return time.monotonic() - start
        except MeshllmError as exc:
            if "timed out" not in str(exc):
                return time.monotonic() - start
        write_raw(stream, b"\x00")
    return None


async def forge_notices(mallory: Attacker, targets: list[tuple[str, str]], until: float) -> None:
    """Every 2 s, tell each target (mesh address) that its victim (node id) is down, two ways:
    at a sequence the victim can never exceed, and at the one the victim holds now."""
    assert mallory.service.gossip is not None
    while time.monotonic() < until:
        now = time.time()
        for addr, victim in targets:
            entry = mallory.service.gossip.state.peers.get(victim)
            held = entry.record.seq if entry is not None else 1
            notices = [sign_notice(mallory.key.signing_key, DownNotice(victim, seq, mallory.node_id, now))
                       for seq in (SEQ_LIMIT - 1, held)]
            with contextlib.suppress(MeshllmError):
                await mallory.send_gossip(await mallory.connect(addr, timeout=2.0), Notices(notices))
        await asyncio.sleep(2.0)
