"""No ghosts: an old signed record cannot bring back a node that left or died.

Finding: after B left and its tombstone expired (~300 s), replaying B's old signed alive record
brought B back: alive and listed in ``/v1/models`` for ~120 s. Records now carry the time they were
signed, and no copy older than ``RECORD_MAX_AGE_S`` is accepted, tombstone or not.

The first test replays the finding at its real timings on the gossip core (simulated clock: the
tombstone takes five minutes to expire); the second shows the same rule on real nodes.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from attacker import Attacker
from nacl.signing import SigningKey
from nodes import NodeProcess, sees, wait_until

from meshllm.identity.ids import node_id as node_id_of
from meshllm.identity.signing import sign
from meshllm.mesh.gossip import Gossip
from meshllm.mesh.messages import Exchange
from meshllm.mesh.records import RECORD_DOMAIN, PeerRecord, RecordVerifier, decode_record

pytestmark = pytest.mark.timeout(120)


def signed_record(key: SigningKey, fields: dict[str, Any]) -> bytes:
    """A record signed by ``key``, built field by field (as a replaying member holds the bytes)."""
    return msgspec.msgpack.encode(sign(key, RECORD_DOMAIN, fields))


def sim_record(key: SigningKey, seq: int, signed_at: float, state: str = "alive") -> bytes:
    nid = node_id_of(bytes(key.verify_key))
    return signed_record(key, {"node_id": nid, "mesh_id": "simmesh", "seq": seq, "membership_proof": b"member",
                               "name": "b", "state": state, "signed_at": signed_at})


def test_replaying_a_left_nodes_record_after_its_tombstone_expired_is_refused() -> None:
    a_key, b_key = SigningKey.generate(), SigningKey.generate()
    a_record = PeerRecord(node_id=node_id_of(bytes(a_key.verify_key)), mesh_id="simmesh", seq=1,
                          membership_proof=b"member")
    members_only = RecordVerifier("simmesh", lambda *_: None, lambda *_: None)  # membership is not the point
    a = Gossip(a_key, a_record, members_only, random.Random(0), now=0.0)
    b_id = node_id_of(bytes(b_key.verify_key))
    alive = sim_record(b_key, 5, signed_at=10.0)
    a.receive("mallory", Exchange([alive]), now=10.0)
    assert b_id in a.members()
    a.receive("b", Exchange([sim_record(b_key, 6, signed_at=20.0, state="leaving")]), now=20.0)
    assert b_id not in a.members()
    t = 20.0
    while t < 400.0:  # the leave tombstone is forgotten after 300 s
        t += 1.0
        a.tick(t)
    assert b_id not in a.state.peers
    a.receive("mallory", Exchange([alive]), now=t)  # the replay
    assert b_id not in a.members(), "B's old alive record brought B back"


def test_a_copy_of_a_dead_nodes_record_signed_long_ago_is_refused(
        pair: tuple[NodeProcess, NodeProcess], tmp_path: Path) -> None:
    a, b = pair

    async def attack() -> bool:
        mallory = Attacker(a.ready["invite"])
        await mallory.start()
        assert mallory.service.gossip is not None
        await asyncio.to_thread(wait_until, lambda: b.node_id in mallory.service.gossip.members(), 10.0)
        held = mallory.service.gossip.members()[b.node_id]
        b_key = SigningKey((tmp_path / "b" / "node.key").read_bytes())
        b.kill()
        await asyncio.to_thread(wait_until, lambda: not sees(a, b.node_id), 15.0)
        # B's record as B signed it 200 s ago, one version past the tombstone A keeps for it: what a
        # member replays once the tombstone is gone (or to a node that never saw B die).
        fields = msgspec.structs.asdict(held)
        fields.update(seq=held.seq + 10, signed_at=time.time() - 200.0, name="ghost")
        raw = signed_record(b_key, fields)
        assert decode_record(raw)[1].node_id == b.node_id
        conn = await mallory.connect(a.mesh_addr)
        await mallory.send_gossip(conn, Exchange([raw]))
        await asyncio.sleep(2.0)
        back = await asyncio.to_thread(sees, a, b.node_id)
        await mallory.stop()
        return back

    assert not asyncio.run(attack()), "a record B signed 200 s ago brought B back"
