"""The owner's standing is no invite a member can reuse, and a revoked node cannot re-key its way back.

Findings: any member could read the invite inside the owner's membership proof (in its gossiped
record) and admit fresh node keys with it; a node the owner had just revoked re-keyed and was back
in, admitted and in every view.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from attacker import Attacker, invites_in
from nacl.signing import SigningKey
from nodes import NodeProcess, meshllm, meshllm_json, sees, wait_until

from meshllm.mesh.admission import encode_token
from meshllm.mesh.membership import join_mesh
from meshllm.net import ConnectError, Endpoint
from meshllm.wire.addr import parse_addr

pytestmark = pytest.mark.timeout(120)


async def try_join(token: str, target: NodeProcess, key: SigningKey | None = None) -> bool:
    """Whether a fresh node key (or ``key``) presenting ``token`` is admitted by ``target``."""
    key = key or SigningKey.generate()
    proof = join_mesh(key, token, time.time()).proof
    ep = await Endpoint.create(key, "127.0.0.1", 0, admit=lambda *_: None, local_proof=lambda: proof)
    try:
        await ep.connect(parse_addr(target.mesh_addr), timeout=5.0)
        return True
    except ConnectError:
        return False
    finally:
        await ep.close()


async def owner_record_invites(mallory: Attacker, owner: NodeProcess) -> list[str]:
    """Tokens of every invite a member can dig out of the owner's gossiped record."""
    gossip = mallory.service.gossip
    assert gossip is not None
    await asyncio.to_thread(wait_until, lambda: owner.node_id in gossip.members(), 10.0)
    return [encode_token(signed) for signed in invites_in(gossip.members()[owner.node_id].membership_proof)]


def test_no_member_can_admit_fresh_keys_with_the_owners_standing(pair: tuple[NodeProcess, NodeProcess]) -> None:
    a, b = pair

    async def attack() -> tuple[int, list[bool]]:
        mallory = Attacker(a.ready["invite"])
        await mallory.start()
        tokens = await owner_record_invites(mallory, a)
        admitted = [await try_join(token, target) for token in tokens for target in (a, b)]
        await mallory.stop()
        return len(tokens), admitted

    found, admitted = asyncio.run(attack())
    print(f"invites in the owner's record: {found}; fresh keys admitted with them: {sum(admitted)}")
    assert not any(admitted), "a fresh node key got in with the owner's own invite"
    assert found == 0, "the owner's record carries an invite"


def test_a_revoked_node_cannot_come_back_under_a_new_key(pair: tuple[NodeProcess, NodeProcess]) -> None:
    a, b = pair
    token = a.ready["invite"]  # the invite B joined with
    revoked = meshllm_json("mesh", "revoke-node", b.node_id, *a.api_args)
    assert revoked["target"] == b.node_id
    wait_until(lambda: not sees(a, b.node_id), 10.0)

    async def attack() -> dict[str, bool]:
        return {
            "B's own key": await try_join(token, a, SigningKey((b.home / "node.key").read_bytes())),
            "a new key with B's invite": await try_join(token, a),
            "a new key with a fresh invite": await try_join(fresh, a),
        }

    fresh = meshllm("invite", "create", *a.api_args, "--uses", "1").stdout.strip()
    outcome = asyncio.run(attack())
    print(f"after revoking B: {outcome}")
    assert not outcome["B's own key"] and not outcome["a new key with B's invite"], \
        f"the revoked operator got back in: {outcome}"
    assert outcome["a new key with a fresh invite"], "revoking B closed the mesh to newcomers"
