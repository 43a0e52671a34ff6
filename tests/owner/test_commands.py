"""Owner commands and results as envelopes: what the owner's CLI accepts as an answer, and node names."""

from __future__ import annotations

import pytest
from nacl.signing import SigningKey

from meshllm.errors import DecodeError, StaleTimestamp, WrongRecipient, WrongSigner
from meshllm.identity.ids import b32
from meshllm.identity.keys import NodeKey
from meshllm.owner.commands import (
    OwnerCommand,
    OwnerResult,
    command_digest,
    envelope_target,
    open_result,
    pick_node,
    seal_command,
    seal_result,
)

NOW = 1_800_000_000.0
OWNER = SigningKey(b"o" * 32)
OWNER_ID = b32(bytes(OWNER.verify_key))
NODE = NodeKey(SigningKey(b"n" * 32))
OTHER = NodeKey(SigningKey(b"m" * 32))


def test_a_result_opens_only_for_its_command_from_its_node_while_fresh() -> None:
    envelope = seal_command(OWNER, NODE.node_id, OwnerCommand(op="status"), NOW)
    assert envelope_target(envelope) == NODE.node_id
    answer = OwnerResult(command=command_digest(envelope), ok=True, code="ok", message="status", data={"n": 1})
    assert open_result(OWNER, seal_result(NODE, answer, NOW, OWNER_ID), envelope, NODE.node_id, NOW) == answer
    # a refusal of a command that did not open travels signed but in the clear: still checked the same way
    refusal = OwnerResult(command=command_digest(envelope), ok=False, code="tampered", message="no")
    assert open_result(OWNER, seal_result(NODE, refusal, NOW, None), envelope, NODE.node_id, NOW) == refusal

    with pytest.raises(WrongSigner):
        open_result(OWNER, seal_result(OTHER, answer, NOW, OWNER_ID), envelope, NODE.node_id, NOW)
    other = seal_command(OWNER, NODE.node_id, OwnerCommand(op="status"), NOW)
    with pytest.raises(DecodeError, match="another command"):
        open_result(OWNER, seal_result(NODE, answer, NOW, OWNER_ID), other, NODE.node_id, NOW)
    with pytest.raises(StaleTimestamp):
        open_result(OWNER, seal_result(NODE, answer, NOW - 120, OWNER_ID), envelope, NODE.node_id, NOW)
    with pytest.raises(WrongRecipient):
        open_result(OWNER, seal_result(NODE, answer, NOW, OTHER.node_id), envelope, NODE.node_id, NOW)


def test_only_command_envelopes_addressed_to_a_node_name_a_target() -> None:
    with pytest.raises(DecodeError):
        envelope_target(seal_result(NODE, OwnerResult(command=b"", ok=True, code="ok", message=""), NOW, None))
    with pytest.raises(DecodeError):
        envelope_target(b"\x91\x01")


def test_pick_node_by_id_name_or_prefix() -> None:
    nodes = [(NODE.node_id, "alpha"), (OTHER.node_id, "beta")]
    assert pick_node(OTHER.node_id.upper(), nodes) == OTHER.node_id
    assert pick_node("alpha", nodes) == NODE.node_id
    assert pick_node(OTHER.node_id[:6], nodes) == OTHER.node_id
    with pytest.raises(DecodeError, match="no node 'gamma'") as info:
        pick_node("gamma", nodes)
    assert "alpha" in info.value.hint and "beta" in info.value.hint
    with pytest.raises(DecodeError, match="names 2 nodes"):
        pick_node("twin", [(NODE.node_id, "twin"), (OTHER.node_id, "twin")])
    with pytest.raises(DecodeError):
        pick_node(OTHER.node_id[:2], nodes)  # too short a prefix to count
