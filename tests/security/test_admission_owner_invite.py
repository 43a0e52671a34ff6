"""The owner's standing is no invite a member can reuse, and a revoked node cannot re-key its way back.

Findings: any member could read the invite inside the owner's membership proof (in its gossiped
record) and admit fresh node keys with it; a node the owner had just revoked re-keyed and was back
in, admitted and in every view. Round two (issue 29): every member's credential carried its signed
invite in the clear, so a revoked node took the 24 h unlimited invite ``serve`` prints out of
another member's record, re-keyed and was admitted. A signed invite is no longer a token: joining
first-hand needs the invite's joiner key, which only the token holds.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from attacker import Attacker, invites_in
from nacl.signing import SigningKey
from nodes import NodeProcess, meshllm, meshllm_json, sees, wait_until

from meshllm.mesh.admission import Invitation, encode_token
from meshllm.mesh.membership import join_mesh
from meshllm.net import ConnectError, Endpoint
from meshllm.wire.addr import parse_addr

pytestmark = pytest.mark.timeout(120)


async def try_join(token: str, target: NodeProcess, key: SigningKey | None = None,
                   refusals: list[str] | None = None) -> bool:
    """Whether a fresh node key (or ``key``) presenting ``token`` is admitted by ``target`` (the reasons
    for refusals are appended to ``refusals``)."""
    key = key or SigningKey.generate()
    proof = join_mesh(key, token, time.time()).proof
    ep = await Endpoint.create(key, "127.0.0.1", 0, admit=lambda *_: None, local_proof=lambda: proof)
    try:
        await ep.connect(parse_addr(target.mesh_addr), timeout=5.0)
        return True
    except ConnectError as exc:
        if refusals is not None:
            refusals.append(str(exc))
        return False
    finally:
        await ep.close()


async def owner_record_invites(mallory: Attacker, owner: NodeProcess) -> list[str]:
    """Tokens of every invite a member can dig out of the owner's gossiped record."""
    gossip = mallory.service.gossip
    assert gossip is not None
    await asyncio.to_thread(wait_until, lambda: owner.node_id in gossip.members(), 10.0)
    return [encode_token(Invitation(signed)) for signed in invites_in(gossip.members()[owner.node_id].membership_proof)]


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


def test_a_revoked_node_cannot_rejoin_with_an_invite_read_from_gossip(pair: tuple[NodeProcess, NodeProcess]) -> None:
    """B joined with the unlimited invite ``serve`` printed; mallory, on a one-use invite of its own,
    reads B's record, is revoked, and tries that invite under fresh keys at both nodes."""
    a, b = pair
    own = meshllm("invite", "create", *a.api_args, "--uses", "1").stdout.strip()

    async def attack() -> tuple[list[str], dict[str, bool], list[str]]:
        mallory = Attacker(own)
        await mallory.start()
        await mallory.connect(a.mesh_addr)
        gossip = mallory.service.gossip
        assert gossip is not None
        await asyncio.to_thread(wait_until, lambda: b.node_id in gossip.members(), 10.0)
        record = gossip.members()[b.node_id]
        tokens = [encode_token(Invitation(signed)) for signed in invites_in(record.membership_proof)]
        await asyncio.to_thread(meshllm_json, "mesh", "revoke-node", mallory.node_id, *a.api_args)
        await mallory.stop()
        await asyncio.to_thread(wait_until, lambda: not sees(a, mallory.node_id), 10.0)
        refusals: list[str] = []
        outcome = {f"{target.name} with invite {i}": await try_join(token, target, refusals=refusals)
                   for i, token in enumerate(tokens) for target in (a, b)}
        return tokens, outcome, refusals

    tokens, outcome, refusals = asyncio.run(attack())
    print(f"invites read from B's record: {len(tokens)}; fresh keys admitted: {outcome}; reasons: {refusals}")
    assert tokens, "B's record should carry the invite it joined with (its credential must be checkable)"
    assert not any(outcome.values()), f"a fresh key got in with an invite read from gossip: {outcome}"
    assert all("does not hold" in reason for reason in refusals), refusals
