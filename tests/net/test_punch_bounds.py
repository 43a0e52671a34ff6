"""Bounds on the punch exchange: the wire type, the address helper, one NAT opener per peer."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from meshllm.mesh import traversal
from meshllm.mesh.traversal import Traversal, _ip_addrs
from meshllm.net.nat import MAX_PUNCH_ADDRS, PunchConnect, PunchMessage, PunchSync


def test_punch_connect_decode_rejects_too_many_or_too_long_addresses() -> None:
    ok = msgspec.msgpack.encode(PunchConnect([f"10.0.0.{i}:1" for i in range(MAX_PUNCH_ADDRS)]))
    assert len(msgspec.msgpack.decode(ok, type=PunchMessage).addrs) == MAX_PUNCH_ADDRS
    many = msgspec.msgpack.encode({"type": "punch-connect", "addrs": ["10.0.0.1:1"] * 10_000})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(many, type=PunchMessage)
    long = msgspec.msgpack.encode({"type": "punch-connect", "addrs": ["1" * 65]})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(long, type=PunchMessage)


def test_ip_addrs_dedupes_and_truncates() -> None:
    addrs = ["10.0.0.1:5", "10.0.0.1:5", "nonsense", "example.com:5"] + [f"10.0.1.{i}:7" for i in range(20)]
    out = _ip_addrs(addrs)
    assert out[0] == ("10.0.0.1", 5)
    assert len(out) == MAX_PUNCH_ADDRS and len(set(out)) == len(out)


class FakeConn:
    node_id = "peer-1"
    path = "relayed"


class FakeEndpoint:
    local_addr = ("0.0.0.0", 4000)

    def __init__(self) -> None:
        self.observed_addrs: set[Any] = set()
        self.peers = {"peer-1": FakeConn()}
        self.punching: set[str] = set()
        self.sent: list[Any] = []

    def on_stream(self, kind: str, handler: Any) -> None:
        pass

    def sendto(self, data: bytes, addr: Any) -> None:
        self.sent.append(addr)


class FakeStream:
    def __init__(self) -> None:
        self.inbox: list[Any] = [PunchConnect(["10.0.0.9:1"]), PunchSync()]

    async def recv(self, type_: Any, timeout: float | None = None) -> Any:
        return self.inbox.pop(0) if self.inbox else None

    async def send(self, message: Any, timeout: float | None = None) -> None:
        pass


def test_only_one_nat_opener_runs_per_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(traversal, "PUNCH_DIAL_TIMEOUT_S", 0.3)

    async def main() -> None:
        ep = FakeEndpoint()
        trav = Traversal(ep, "off", False, lambda *a, **k: None)  # type: ignore[arg-type]
        conn = FakeConn()
        for _ in range(20):  # a peer repeating the exchange quickly
            await trav._serve_punch(FakeStream(), conn)  # type: ignore[arg-type]
        assert len(trav._tasks) == 1 and trav._mapping == {"peer-1"}
        await asyncio.gather(*trav._tasks)
        assert trav._mapping == set()
        await trav._serve_punch(FakeStream(), conn)  # type: ignore[arg-type]
        assert len(trav._tasks) == 1  # a later attempt may open the NAT again
        ep.peers.clear()
        await asyncio.gather(*trav._tasks)
        await trav.close()

    asyncio.run(main())
