"""The mesh service over real QUIC on 127.0.0.1: who gets in, and what an admitted peer cannot do."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nacl.signing import SigningKey
from net.net_helpers import until as net_until

from meshllm.errors import ConfigError
from meshllm.identity.ids import node_id
from meshllm.identity.keys import NodeKey
from meshllm.identity.signing import sign
from meshllm.identity.trust import TrustPolicy, TrustStore
from meshllm.mesh import service as service_module
from meshllm.mesh.admission import MeshKey, encode_token, inspect_token, joining_credential, with_grant
from meshllm.mesh.failure import Failed, Recovered, Suspected
from meshllm.mesh.membership import Membership, join_mesh, own_mesh
from meshllm.mesh.messages import Ack, Digest, Exchange, Ping, Summary, decode_message, encode_message
from meshllm.mesh.records import PeerRecord, sign_record
from meshllm.mesh.service import DATAGRAM_MESSAGE_MAX, GOSSIP_STREAM, HEARD_S, STALE_LINK_S, MeshService
from meshllm.mesh.view import PeerAdded
from meshllm.net.connection import PeerConnection
from meshllm.net.endpoint import Endpoint
from meshllm.net.errors import AdmissionRefused, StreamClosed

pytestmark = pytest.mark.timeout(60)


def record_for(key: NodeKey, membership: Membership, name: str) -> PeerRecord:
    return PeerRecord(node_id=key.node_id, mesh_id=membership.mesh_id, seq=0,
                      membership_proof=membership.proof, name=name, role="client")


class Harness:
    """An owner service and helpers to make joiners and raw endpoints."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.owner_key = NodeKey.ephemeral()
        self.owner_membership = own_mesh(self.owner_key.signing_key, None, time.time())
        assert self.owner_membership.mesh_key is not None
        self.mesh_key: MeshKey = self.owner_membership.mesh_key
        self.owner = self.service(self.owner_key, self.owner_membership, "owner", self.events)
        self.extra: list[MeshService | Endpoint] = []
        self.grants: dict[str, bytes] = {}
        """What the owner granted each raw endpoint that joined through it."""

    def service(self, key: NodeKey, membership: Membership, name: str,
                events: list[tuple[str, dict[str, Any]]] | None = None) -> MeshService:
        sink = events if events is not None else []
        return MeshService(key, membership, record_for(key, membership, name), check_trust=lambda *a: None,
                           on_event=lambda t, **f: sink.append((t, f)), host="127.0.0.1", port=0)

    @property
    def owner_addr(self) -> tuple[str, int]:
        assert self.owner.endpoint is not None
        return self.owner.endpoint.local_addr

    def token(self, **kw: Any) -> str:
        kw.setdefault("max_uses", 0)
        return encode_token(self.mesh_key.invite(time.time(), bootstrap=[f"127.0.0.1:{self.owner_addr[1]}"], **kw))

    async def raw_endpoint(self, proof: bytes, key: SigningKey | None = None) -> Endpoint:
        key = key or SigningKey.generate()
        ep = await Endpoint.create(key, "127.0.0.1", 0, admit=lambda *a: None, local_proof=lambda: proof,
                                   take_grant=lambda _peer, grant: self.grants.__setitem__(ep.node_id, grant))
        self.extra.append(ep)
        return ep

    async def close(self) -> None:
        for item in self.extra:
            await (item.stop(graceful=False) if isinstance(item, MeshService) else item.close())
        await self.owner.stop(graceful=False)


def run(body: Callable[[Harness], Awaitable[None]]) -> None:
    async def main() -> None:
        harness = Harness()
        await harness.owner.start()
        try:
            await body(harness)
        finally:
            await harness.close()

    asyncio.run(main())


def proof_for(key: SigningKey, token: str) -> bytes:
    return join_mesh(key, token, time.time()).proof


@pytest.mark.parametrize("case", ["no invite", "garbage proof", "expired invite", "revoked invite",
                                  "other mesh", "claims another node id"])
def test_refused_joiners_never_get_in(case: str) -> None:
    async def body(h: Harness) -> None:
        key = SigningKey.generate()
        if case == "no invite":
            proof = b""
        elif case == "garbage proof":
            proof = b"\x93\x01\x02\x03"
        elif case == "expired invite":
            signed = h.mesh_key.invite(time.time() - 7200, ttl_s=3600)
            proof = joining_credential(key, signed, time.time() - 7100)
        elif case == "revoked invite":
            token = h.token()
            h.owner.admission.apply_revocation(h.mesh_key.revoke("invite", inspect_token(token).invite_id, time.time()))
            proof = proof_for(key, token)
        elif case == "other mesh":
            other = MeshKey.generate()
            proof = joining_credential(key, other.invite(time.time()), time.time())
        else:  # a valid proof, but made by another node's key than the one in our TLS certificate
            proof = proof_for(SigningKey.generate(), h.token())
        ep = await h.raw_endpoint(proof, key)
        with pytest.raises(AdmissionRefused):
            await ep.connect(h.owner_addr, timeout=5)
        assert h.owner.gossip is not None and not h.owner.gossip.members()
        assert h.owner.endpoint is not None and not h.owner.endpoint.peers

    run(body)


@pytest.mark.parametrize("policy", ["revoked", "allowlist"])
def test_local_trust_policy_refuses_at_admission_despite_a_valid_invite(policy: str, tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        key = SigningKey.generate()
        trust = TrustStore.load(tmp_path)
        if policy == "revoked":
            trust.revoke_node(node_id(bytes(key.verify_key)))
        else:
            trust.set_policy(TrustPolicy.ALLOWLIST)
        h.owner._check_node_id = trust.check_node_id
        ep = await h.raw_endpoint(proof_for(key, h.token()), key)
        with pytest.raises(AdmissionRefused):
            await ep.connect(h.owner_addr, timeout=5)
        assert h.owner.endpoint is not None and not h.owner.endpoint.peers

    run(body)


def test_valid_joiner_is_admitted_and_gossiped() -> None:
    async def body(h: Harness) -> None:
        key = NodeKey.ephemeral()
        joiner = h.service(key, join_mesh(key.signing_key, h.token(), time.time()), "joiner")
        h.extra.append(joiner)
        await joiner.start()
        assert joiner.gossip is not None and h.owner.gossip is not None
        await until(lambda: key.node_id in h.owner.gossip.members()  # type: ignore[union-attr]
                    and h.owner_key.node_id in joiner.gossip.members())  # type: ignore[union-attr]
        assert h.owner.gossip.members()[key.node_id].name == "joiner"

    run(body)


def test_a_joiner_knows_the_mesh_once_its_first_view_returns() -> None:
    """``first_view`` (the node awaits it after ``start``, before it says it is ready) returns once a member
    answered the joiner's first want list: every member that member held is in the joiner's view then.
    Whichever member answers first (the owner, or one that dialed the joiner), the mesh is settled
    first, so each holds them all."""
    async def body(h: Harness) -> None:
        services = [await joined(h, f"m{i}") for i in range(3)]
        members = [key.node_id for _, key in services]
        everyone = {h.owner_key.node_id, *members}
        await until(lambda: all(everyone - {svc.node_id} <= set(svc.gossip.members())  # type: ignore[union-attr]
                                for svc in [h.owner, *(svc for svc, _ in services)]))
        key = NodeKey.ephemeral()
        late = h.service(key, join_mesh(key.signing_key, h.token(), time.time()), "late")
        h.extra.append(late)
        await late.start()
        await late.first_view()
        assert late.gossip is not None and late.gossip.answered
        assert everyone <= set(late.gossip.members())

    run(body)


async def admitted_raw_peer(h: Harness) -> tuple[Any, SigningKey, bytes]:
    """A raw endpoint admitted by the owner, and its credential completed with the owner's grant."""
    key = SigningKey.generate()
    proof = proof_for(key, h.token())
    ep = await h.raw_endpoint(proof, key)
    conn = await ep.connect(h.owner_addr, timeout=5)
    return conn, key, with_grant(proof, h.grants[ep.node_id])


async def send_gossip(conn: Any, message: Any) -> None:
    stream = await conn.open_stream(GOSSIP_STREAM)
    await stream.send(message)
    stream.close()


async def gossip_honest_record(h: Harness, conn: Any, key: SigningKey, credential: bytes, name: str) -> PeerRecord:
    """Gossip a valid record for ``key`` through ``conn``; return it once the owner has stored it."""
    record = PeerRecord(node_id=node_id(bytes(key.verify_key)), mesh_id=h.mesh_key.mesh_id, seq=10,
                        signed_at=time.time(), membership_proof=credential, name=name)
    await send_gossip(conn, Exchange([sign_record(key, record)]))
    assert h.owner.gossip is not None
    await until(lambda: record.node_id in h.owner.gossip.members())  # type: ignore[union-attr]
    assert h.owner.gossip.members()[record.node_id].name == name
    return record


async def wait_for(h: Harness, kind: str, timeout: float = 3.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for t, fields in h.events:
            if t == kind:
                return fields
        await asyncio.sleep(0.02)
    raise AssertionError(f"no {kind} event; got {[t for t, _ in h.events]}")


@pytest.mark.parametrize("case", ["bad signature", "forged membership proof", "stale sequence", "over size cap",
                                  "another node's record"])
def test_bad_gossiped_records_are_dropped_and_logged(case: str) -> None:
    async def body(h: Harness) -> None:
        conn, key, credential = await admitted_raw_peer(h)
        good = await gossip_honest_record(h, conn, key, credential, "honest")
        nid = good.node_id
        assert h.owner.gossip is not None
        if case == "bad signature":
            raw = bytearray(sign_record(key, msgspec.structs.replace(good, seq=11, name="evil")))
            raw[-1] ^= 1
            raw = bytes(raw)
        elif case == "forged membership proof":
            stranger = SigningKey.generate()
            forged = MeshKey.generate().invite(time.time())
            fake_proof = joining_credential(stranger, forged, time.time())
            raw = sign_record(key, msgspec.structs.replace(good, seq=11, name="evil", membership_proof=fake_proof))
        elif case == "stale sequence":
            raw = sign_record(key, msgspec.structs.replace(good, seq=5, name="evil"))
        elif case == "over size cap":
            raw = b"\x00" * (70 * 1024)
        else:  # a record for the owner's id, signed by this peer
            owner_rec = msgspec.structs.replace(good, node_id=h.owner_key.node_id, seq=10**15, name="evil")
            raw = msgspec.msgpack.encode(sign(key, "peer-record", owner_rec))
        if case == "stale sequence":  # stale copies are routine in gossip: dropped silently, so an
            # oversized record after it in the same message is the barrier: rejected once it was handled
            await send_gossip(conn, Exchange([raw, b"\x00" * (70 * 1024)]))
        else:  # the rejection is logged once the record was handled: nothing more to wait for
            await send_gossip(conn, Exchange([raw]))
        rejected = await wait_for(h, "record_rejected")
        assert rejected["source"] == nid
        assert h.owner.gossip.members()[nid].name == "honest"
        assert h.owner.gossip.own.name == "owner"

    run(body)


def test_malformed_frame_resets_that_stream_not_the_connection() -> None:
    async def body(h: Harness) -> None:
        conn, key, credential = await admitted_raw_peer(h)
        stream = await conn.open_stream(GOSSIP_STREAM)
        await stream.send({"type": "no-such-message", "x": 1})
        with pytest.raises(StreamClosed):
            await stream.recv(dict, timeout=3)
        # The connection and the node still work: an honest record gets through afterwards.
        await gossip_honest_record(h, conn, key, credential, "after")

    run(body)


def test_small_messages_travel_as_datagrams_and_probes_never_on_streams(caplog) -> None:  # type: ignore[no-untyped-def]
    """A SWIM ping is one datagram and so is its ack; a summary is one too, and so is the digest that answers
    it. A ping on a gossip stream and a datagram that does not decode are each refused with a strike."""
    async def body(h: Harness) -> None:
        conn, key, credential = await admitted_raw_peer(h)
        got: list[Any] = []
        conn.endpoint.on_datagram = lambda _conn, data: got.append(decode_message(data))
        assert conn.send_datagram(encode_message(Ping(7)))
        await until(lambda: Ack(7) in got)
        summary = encode_message(Summary(1, bytes(8 * 16)))  # differs from the owner's in its buckets
        assert len(summary) <= DATAGRAM_MESSAGE_MAX and conn.send_datagram(summary)
        await until(lambda: any(isinstance(m, Digest) for m in got))  # answered, by datagram too
        stream = await conn.open_stream(GOSSIP_STREAM)
        await stream.send(Ping(8))
        with pytest.raises(StreamClosed):
            await stream.recv(dict, timeout=3)
        await until(lambda: "a probe on a gossip stream" in caplog.text)
        assert Ack(8) not in got
        conn.send_datagram(b"\x81\xa4junk")
        await until(lambda: "bad gossip datagram" in caplog.text)
        await gossip_honest_record(h, conn, key, credential, "after")  # two strikes: still a member

    run(body)


async def joined(h: Harness, name: str) -> tuple[MeshService, NodeKey]:
    """A member that joined through the owner and sees it."""
    key = NodeKey.ephemeral()
    svc = h.service(key, join_mesh(key.signing_key, h.token(), time.time()), name)
    h.extra.append(svc)
    await svc.start()
    assert svc.gossip is not None
    await until(lambda: h.owner_key.node_id in svc.gossip.members())  # type: ignore[union-attr]
    return svc, key


async def known_to_owner(h: Harness, name: str) -> tuple[MeshService, str, PeerConnection]:
    """A member that joined, once the owner holds it: the member, its id and the owner's connection to it."""
    svc, key = await joined(h, name)
    owner = h.owner
    assert owner.gossip is not None and owner.endpoint is not None
    await until(lambda: key.node_id in owner.gossip.members())  # type: ignore[union-attr]
    return svc, key.node_id, owner.endpoint.peers[key.node_id]


def until(predicate: Callable[[], bool], timeout: float = 10.0) -> Awaitable[None]:
    """``net_helpers.until`` with the longer default that gossip rounds between services need."""
    return net_until(predicate, timeout)


def test_revoked_node_is_dropped_by_every_member_and_refused_afterwards() -> None:
    async def body(h: Harness) -> None:
        other, _ = await joined(h, "other")
        victim, victim_key = await joined(h, "victim")
        assert other.gossip is not None and other.endpoint is not None
        await until(lambda: victim_key.node_id in other.gossip.members())  # type: ignore[union-attr]
        await until(lambda: victim_key.node_id in other.endpoint.peers)  # type: ignore[union-attr]
        rev = h.owner.revoke("node", victim_key.node_id)
        assert rev.target == victim_key.node_id and rev.target_kind == "node"
        # Another member (not the owner) drops it as revoked and closes its connection.
        await until(lambda: victim_key.node_id not in other.gossip.members())  # type: ignore[union-attr]
        assert other.gossip.state.peers[victim_key.node_id].status == "revoked"
        await until(lambda: victim_key.node_id not in other.endpoint.peers)  # type: ignore[union-attr]
        assert victim_key.node_id in other.admission.revoked_nodes
        await victim.stop(graceful=False)
        # Its reconnection, with its (otherwise valid) proof, is refused by that member.
        ep = await h.raw_endpoint(victim.membership.proof, victim_key.signing_key)
        with pytest.raises(AdmissionRefused):
            await ep.connect(other.endpoint.local_addr, timeout=5)
        assert victim_key.node_id not in other.gossip.members()

    run(body)


def test_revoked_invite_is_refused_by_a_member_that_is_not_the_owner() -> None:
    async def body(h: Harness) -> None:
        other, _ = await joined(h, "other")
        assert other.endpoint is not None
        token = h.token()
        invite_id = inspect_token(token).invite_id
        h.owner.revoke("invite", invite_id)
        await until(lambda: invite_id in other.admission.revoked_invites)
        key = SigningKey.generate()
        ep = await h.raw_endpoint(proof_for(key, token), key)
        with pytest.raises(AdmissionRefused):
            await ep.connect(other.endpoint.local_addr, timeout=5)
        assert node_id(bytes(key.verify_key)) not in other.endpoint.peers

    run(body)


def test_a_late_joiner_learns_earlier_revocations_when_greeted() -> None:
    async def body(h: Harness) -> None:
        h.owner.revoke("invite", "aaaaaaaaaaaaaaaa")
        late, _ = await joined(h, "late")
        await until(lambda: "aaaaaaaaaaaaaaaa" in late.admission.revoked_invites)

    run(body)


def test_only_the_mesh_key_holder_can_revoke() -> None:
    async def body(h: Harness) -> None:
        other, _ = await joined(h, "other")
        with pytest.raises(ConfigError):
            other.revoke("node", h.owner_key.node_id)

    run(body)


def test_revocations_survive_a_restart(tmp_path: Path) -> None:
    async def main() -> None:
        key, victim = NodeKey.ephemeral(), NodeKey.ephemeral()
        membership = own_mesh(key.signing_key, None, time.time())
        assert membership.mesh_key is not None
        saved = tmp_path / "revocations.msgpack"

        def owner() -> MeshService:
            return MeshService(key, membership, record_for(key, membership, "owner"), check_trust=lambda *a: None,
                               on_event=lambda t, **f: None, host="127.0.0.1", port=0, revocations_file=saved)

        first = owner()
        await first.start()
        first.revoke("node", victim.node_id)
        await first.stop(graceful=False)
        assert saved.exists() and saved.stat().st_mode & 0o777 == 0o600

        second = owner()
        await second.start()
        try:
            assert victim.node_id in second.admission.revoked_nodes
            assert second.endpoint is not None
            token = encode_token(membership.mesh_key.invite(time.time(), max_uses=0))
            proof = join_mesh(victim.signing_key, token, time.time()).proof
            ep = await Endpoint.create(victim.signing_key, "127.0.0.1", 0, admit=lambda *a: None,
                                       local_proof=lambda: proof)
            try:
                with pytest.raises(AdmissionRefused, match="revoked"):
                    await ep.connect(second.endpoint.local_addr, timeout=5)
            finally:
                await ep.close()
        finally:
            await second.stop(graceful=False)

    asyncio.run(main())


def test_a_joiner_through_a_member_carries_that_members_grant() -> None:
    async def body(h: Harness) -> None:
        member, member_key = await joined(h, "member")
        key = NodeKey.ephemeral()
        membership = join_mesh(key.signing_key, h.token(), time.time())
        membership.bootstrap = list(member.listen_addrs())
        joiner = h.service(key, membership, "joiner")
        h.extra.append(joiner)
        await joiner.start()
        standing = h.owner.admission.standing(key.node_id, joiner.membership.proof, time.time())
        assert standing.admitters == (member_key.node_id,)  # attributable to the member
        assert h.owner.gossip is not None
        await until(lambda: key.node_id in h.owner.gossip.members())  # type: ignore[union-attr]
        # Revoking the member voids its grants: the joiner leaves every view with it.
        h.owner.revoke("node", member_key.node_id)
        await until(lambda: key.node_id not in h.owner.gossip.members())  # type: ignore[union-attr]
        assert h.owner.gossip.state.peers[key.node_id].status == "revoked"

    run(body)


def test_revoking_a_node_closes_the_invite_it_joined_with() -> None:
    async def body(h: Harness) -> None:
        token = h.token()
        key = NodeKey.ephemeral()
        victim = h.service(key, join_mesh(key.signing_key, token, time.time()), "victim")
        h.extra.append(victim)
        await victim.start()
        assert h.owner.gossip is not None
        await until(lambda: key.node_id in h.owner.gossip.members())  # type: ignore[union-attr]
        rev = h.owner.revoke("node", key.node_id)
        assert rev.closes == inspect_token(token).invite_id
        fresh = SigningKey.generate()
        ep = await h.raw_endpoint(proof_for(fresh, token), fresh)
        with pytest.raises(AdmissionRefused, match="closed"):
            await ep.connect(h.owner_addr, timeout=5)

    run(body)


def test_a_member_comes_back_after_its_invite_expired_with_its_saved_credential(tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        token = h.token(ttl_s=1.5)
        expires = inspect_token(token).expires
        key = NodeKey.ephemeral()
        first = h.service(key, join_mesh(key.signing_key, token, time.time(), home=tmp_path), "member")
        await first.start()
        await first.stop(graceful=True)
        await until(lambda: time.time() > expires, 5.0)  # the invite is gone now
        again = h.service(key, join_mesh(key.signing_key, token, time.time(), home=tmp_path), "member")
        h.extra.append(again)
        await again.start()  # admitted: its credential carries the owner's grant
        assert h.owner.gossip is not None
        await until(lambda: key.node_id in h.owner.gossip.members())  # type: ignore[union-attr]
        stranger = NodeKey.ephemeral()
        late = h.service(stranger, join_mesh(stranger.signing_key, token, time.time(), home=tmp_path / "x"), "late")
        with pytest.raises(AdmissionRefused, match="expired"):
            await late.start()
        await late.stop(graceful=False)

    run(body)


def test_a_connection_the_dialer_no_longer_wants_is_closed_once_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rotated out of the dialer's partial view and carrying no work: the dialer closes it (the acceptor
    never does: it cannot tell whether the dialer still wants it). Pruning is not leaving: both views
    keep each other. Without this, gossip rounds kept every connection ever made alive."""
    monkeypatch.setattr(service_module, "PRUNE_AFTER_S", 0.3)

    async def body(h: Harness) -> None:
        joiner, key = await joined(h, "joiner")
        assert joiner.gossip is not None and h.owner.gossip is not None
        assert joiner.endpoint is not None and h.owner.endpoint is not None
        await until(lambda: key.node_id in h.owner.gossip.members())  # type: ignore[union-attr]
        conn = joiner.endpoint.peers[h.owner_key.node_id]
        assert conn.dialer
        h.owner.gossip.desired_connections = lambda now: set()  # type: ignore[method-assign]
        await asyncio.sleep(0.8)
        assert conn.close_reason is None  # the acceptor keeps what the dialer wanted

        done = asyncio.Event()

        async def hold(stream: Any, _conn: Any) -> None:
            await done.wait()

        h.owner.endpoint.on_stream("work", hold)
        stream = await conn.open_stream("work")
        await stream.send(b"x")
        joiner.gossip.desired_connections = lambda now: set()  # type: ignore[method-assign]
        await asyncio.sleep(0.8)
        assert conn.close_reason is None  # a stream of work keeps it
        done.set()
        stream.close()
        await until(lambda: conn.close_reason is not None)
        assert "rotated out" in conn.close_reason
        assert h.owner_key.node_id in joiner.gossip.members() and key.node_id in h.owner.gossip.members()

    run(body)


def test_a_down_notice_leaves_the_connection_and_our_own_verdict_closes_it() -> None:
    """Another member's down notice about a peer we hold a connection to leaves that connection open: a
    wrong notice (a loaded host) is refuted and the peer comes back on it, with no redial; a dead peer's
    connection ends by itself. Our own detector's verdict (the peer went silent to us) closes it."""
    async def body(h: Harness) -> None:
        accuser, _ = await joined(h, "accuser")
        _, victim_key = await joined(h, "victim")
        owner = h.owner
        assert owner.gossip is not None and owner.endpoint is not None and accuser.gossip is not None
        vid = victim_key.node_id
        await until(lambda: vid in accuser.gossip.members() and vid in owner.gossip.members())  # type: ignore[union-attr]
        conn = owner.endpoint.peers[vid]
        owner.gossip.watched = lambda: set()  # type: ignore[method-assign]  # our probes would refute the notice
        seq = owner.gossip.state.peers[vid].record.seq
        accuser._handle(accuser.gossip.declare_down(vid, time.time()))
        await until(lambda: owner.gossip.state.peers[vid].record.seq > seq  # type: ignore[union-attr]
                    and vid in owner.gossip.members())  # type: ignore[union-attr]
        # it was down here meanwhile, and the event says on whose word
        assert ("peer_left", {"node_id": vid, "reason": "down", "accuser": accuser.node_id}) in h.events
        assert owner.endpoint.peers[vid] is conn and conn.close_reason is None
        owner._handle(owner.gossip.on_detector(owner._probe([Failed(vid)]), time.time()))
        await until(lambda: conn.close_reason is not None)
        assert "failure detector" in conn.close_reason
        ours = [f for t, f in h.events if t == "peer_left" and f.get("accuser") == owner.node_id]
        assert len(ours) == 1 and ours[0]["node_id"] == vid and 0 <= ours[0]["silent_s"] < 60, ours

    run(body)


def test_a_member_back_from_down_over_a_silent_connection_gets_a_new_one() -> None:
    """A down notice leaves our connection to the accused open (the test above). If that connection has
    carried nothing for a while when the member comes back, it is from the member's earlier life (killed
    and restarted; its new record came through others): our detector probing into it would declare the
    new life down. It is closed instead; one that still carries packets stays."""
    async def body(h: Harness) -> None:
        _, vid, conn = await known_to_owner(h, "victim")
        owner = h.owner
        assert owner.gossip is not None
        back = PeerAdded(vid, owner.gossip.state.peers[vid].record)
        owner._report(back)
        assert conn.close_reason is None  # it spoke within the last seconds
        conn.heard_at -= STALE_LINK_S + 1
        owner._report(back)
        assert conn.close_reason == "silent since before the peer came back"

    run(body)


def test_the_transport_waits_as_long_as_the_detectors_local_health_says() -> None:
    """The endpoint's patience is the failure detector's stretch: 1 on a healthy node, more once its loop
    runs late (its request probes and dials then wait longer)."""
    async def body(h: Harness) -> None:
        owner = h.owner
        assert owner.endpoint is not None
        assert owner.endpoint.patience("anyone") == 1
        owner.detector.health = 3
        assert owner.endpoint.patience("anyone") == 4
        owner.detector.health = 0

    run(body)


def test_a_suspect_whose_packets_still_arrive_is_cleared() -> None:
    """A suspect whose connection delivered a packet within HEARD_S (its loop runs: QUIC ACKs, the
    transport's probes) is alive again at the next tick, whatever became of the detector's pings; one
    whose connection has been silent longer stays suspect, and its verdict comes as before."""
    async def body(h: Harness) -> None:
        victim, vid, conn = await known_to_owner(h, "victim")
        owner = h.owner
        assert owner.gossip is not None
        victim.detector.receive = lambda *args, **kwargs: []  # type: ignore[method-assign]  # pings unanswered
        loop = asyncio.get_running_loop()
        owner.detector.suspect(vid, time.time())
        conn.heard_at = loop.time() - 2 * HEARD_S  # silent: no packet since
        assert owner._heard_suspects() == [] and vid in owner.detector.suspects
        owner._handle(owner.gossip.on_detector([Suspected(vid)], time.time()))
        assert owner.gossip.state.peers[vid].status == "suspect"
        # the victim's transport still talks, so the next tick clears it long before a verdict could come
        await until(lambda: vid not in owner.detector.suspects, timeout=0.9)
        assert owner.gossip.state.peers[vid].status == "alive"
        assert loop.time() - conn.heard_at < HEARD_S
        owner.detector.suspect(vid, time.time())
        assert owner._heard_suspects() == [Recovered(vid)]

    run(body)
