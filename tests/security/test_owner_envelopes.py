"""A hostile member on the ``owner`` stream: junk envelopes and floods are refused, struck and cooled down.

Envelopes are end-to-end signed, so a member can neither forge nor alter a command (tests/node/
test_owner_commands.py); what it can still try is to make nodes work: relay junk, or send commands
faster than any owner would. Both are bounded per peer, and each overstep is a strike.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from attacker import Attacker
from nodes import NodeProcess, wait_until

from meshllm.errors import MeshllmError
from meshllm.net.limits import STRIKES_TO_COOL_DOWN
from meshllm.owner.commands import OwnerCommand, seal_command
from meshllm.owner.relay import RATE_BURST, RATE_PER_S, STREAM_KIND, Deliver, OwnerFrame, Undeliverable

pytestmark = pytest.mark.timeout(120)


async def send(conn: object, frame: Deliver) -> object:
    """The answer to one Deliver frame, or the error that ended the stream (the peer was cut off)."""
    try:
        stream = await conn.open_stream(STREAM_KIND)  # type: ignore[attr-defined]
        await stream.send(frame, timeout=5)
        return await stream.recv(OwnerFrame, timeout=10)
    except MeshllmError as exc:
        return exc


def test_junk_envelopes_are_refused_and_their_sender_cooled_down(pair: tuple[NodeProcess, NodeProcess]) -> None:
    a, _ = pair

    async def attack() -> list[object]:
        mallory = Attacker(a.ready["invite"])
        await mallory.start()
        conn = await mallory.connect(a.mesh_addr)
        answers = []
        for _ in range(3):
            answers.append(await send(conn, Deliver(b"not an envelope", a.node_id, 0, [], 5000)))
        await mallory.stop()
        return answers

    answers = asyncio.run(attack())
    # the third strike cuts the connection, so its answer may not arrive
    assert all(isinstance(x, Undeliverable) and x.reason.startswith("refused") for x in answers[:2]), answers
    wait_until(lambda: any(e["type"] == "peer_cooled" for e in a.events), 10.0)
    assert not any(e["type"] == "owner_refused" for e in a.events)  # junk never reached the command gate


def test_a_command_flood_is_cut_at_the_rate_limit(pair: tuple[NodeProcess, NodeProcess]) -> None:
    a, _ = pair
    # The bucket refills while the flood arrives, so the flood outruns the burst by what a 5 s spread
    # (a loaded host) refills, plus the strikes that cool a peer down.
    flood = RATE_BURST + int(RATE_PER_S * 5) + STRIKES_TO_COOL_DOWN

    async def attack() -> list[object]:
        mallory = Attacker(a.ready["invite"])
        await mallory.start()
        conn = await mallory.connect(a.mesh_addr)
        frames = [Deliver(seal_command(mallory.key.signing_key, a.node_id, OwnerCommand(op="drain"), time.time()),
                          a.node_id, 0, [], 5000) for _ in range(flood)]
        answers = await asyncio.gather(*(send(conn, f) for f in frames))
        await mallory.stop()
        return list(answers)

    answers = asyncio.run(attack())
    limited = [x for x in answers if isinstance(x, Undeliverable) and "slow down" in x.reason]
    assert limited, answers[:3]
    wait_until(lambda: any(e["type"] == "peer_cooled" for e in a.events), 10.0)
    refusals = [e for e in a.events if e["type"] == "owner_refused"]
    assert 0 < len(refusals) <= RATE_BURST and all(e["code"] == "uncertified" for e in refusals)
