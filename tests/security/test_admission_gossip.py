"""Invite expiry and use limits cannot be bypassed through gossip.

Finding: records of new node ids carrying proofs on a used-up ``max_uses=1`` invite, or on an
expired invite with a backdated ``joined``, pushed by one member, entered every view; the owner
then dialed them (they were "known members") and admitted them. Now a record needs the grant of
the member that admitted it first-hand under the live-invite rules, and every member counts the
uses it knows of.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from attacker import Attacker
from nodes import NodeProcess, meshllm, sees, wait_until

from meshllm.errors import MeshllmError
from meshllm.mesh.admission import inspect_token
from meshllm.mesh.messages import Exchange

pytestmark = pytest.mark.timeout(120)


def invite(a: NodeProcess, *args: str) -> str:
    done = meshllm("invite", "create", *a.api_args, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_used_up_and_expired_invites_do_not_get_in_through_gossip(pair: tuple[NodeProcess, NodeProcess]) -> None:
    a, b = pair
    one_use = invite(a, "--uses", "1")
    short = invite(a, "--uses", "0", "--ttl", "2")
    expired_at = inspect_token(short).expires

    async def attack() -> dict[str, list[str]]:
        first = Attacker(one_use, name="first-user")  # uses the one-use invite honestly, through A
        await first.start()
        mallory = Attacker(a.ready["invite"])
        await mallory.start()
        mallory.admit_anyone()  # a member whose admission code lets anything in
        await asyncio.sleep(max(0.0, expired_at - time.time() + 0.5))
        sybils = {
            "used-up": Attacker(one_use, name="used-up", bootstrap=[mallory.mesh_addr]),
            "expired": Attacker(short, name="expired", bootstrap=[mallory.mesh_addr], joined=expired_at - 1),
        }
        for sybil in sybils.values():
            with contextlib.suppress(MeshllmError):  # it may refuse what mallory handed it
                await sybil.start()  # (its record exists either way, to be pushed)
        to_a = await mallory.connect(a.mesh_addr)
        to_b = await mallory.connect(b.mesh_addr)
        await mallory.send_gossip(to_a, Exchange([s.own_record() for s in sybils.values()]))
        await mallory.send_gossip(to_b, Exchange([s.own_record() for s in sybils.values()]))
        await asyncio.sleep(4.0)  # gossip, and the sybils' own dials to A and B
        inside = {label: [n.name for n in (a, b) if await asyncio.to_thread(sees, n, s.node_id)]
                  for label, s in sybils.items()}
        for node in [first, mallory, *sybils.values()]:
            await node.stop()
        return inside

    inside = asyncio.run(attack())
    print(f"sybil records held by: {inside}")
    assert not any(inside.values()), f"records on spent invites entered views: {inside}"
    wait_until(lambda: sees(a, b.node_id, ("alive",)), 5.0)
