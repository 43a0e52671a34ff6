"""A forged revocation is dropped with the ``record_rejected`` event docs/identity.md promises.

Finding (issue 29): forged revocations were dropped without that event when the message did not
decode (a revocation over its 1 KiB cap fails at decode, before the gossip core sees it: the
stream was reset and the peer struck, silently), so an operator watching ``/api/events`` could not
see a member trying to eject others.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from attacker import Attacker
from nacl.signing import SigningKey
from nodes import NodeProcess, sees

from meshllm.identity.signing import encode_signed, sign
from meshllm.mesh.admission import REVOCATION_DOMAIN, Revocation
from meshllm.mesh.messages import Revocations

pytestmark = pytest.mark.timeout(60)


def test_forged_revocations_are_reported(pair: tuple[NodeProcess, NodeProcess]) -> None:
    a, b = pair

    async def attack() -> list[dict]:
        mallory = Attacker(a.ready["invite"])
        await mallory.start()
        conn = await mallory.connect(a.mesh_addr)
        mesh_id = mallory.service.membership.mesh_id
        forged = sign(SigningKey.generate(), REVOCATION_DOMAIN, Revocation(mesh_id, "node", b.node_id, time.time()))
        padded = sign(SigningKey.generate(), REVOCATION_DOMAIN,
                      Revocation(mesh_id, "node", b.node_id, time.time(), closes="x" * 2048))
        seen = []
        for raw in (encode_signed(forged), encode_signed(padded)):
            await mallory.send_gossip(conn, Revocations([raw]))
            seen.append(await asyncio.to_thread(a.wait_event, lambda e: e["type"] == "record_rejected"
                                                and e.get("source") == mallory.node_id and e not in seen, 10.0))
        await mallory.stop()
        return seen

    events = asyncio.run(attack())
    print(f"A reported: {events}")
    assert events[0]["error"] in ("WrongSigner", "BadSignature")
    assert events[1]["error"] == "DecodeError"
    assert sees(a, b.node_id, ("alive",)), "the forged revocation took B out"
