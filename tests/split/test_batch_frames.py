"""Batch frames from a peer are validated before anything reaches ggml; a bad one is refused whole,
with an Error for every session it names, and changes nothing (sans-IO, then over a real lane)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import numpy as np
import pytest
from split_helpers import MODEL, PROMPT, addr, endpoint, make_chain, solo_greedy

from meshllm.split import BadFrame, Hop, StageServer, codec
from meshllm.split.frames import MAX_BATCH, Batch, Decode, Error, Open, Prefill, Verify, decode_frame
from meshllm.split.lanes import LaneState

CHAIN = [Hop("coord", "127.0.0.1:1", 0, 2), Hop("me", "127.0.0.1:2", 2, 4)]


def step(session: str, pos: int, n: int = 1, *, width: int = 4, rows: int | None = None,
         draft: list[int] | None = None) -> Decode | Verify:
    x = codec.encode(np.zeros((rows or n, width), np.float32), "f32")
    fields = {"session": session, "pos": pos, "n_tokens": n, "dtype": "f32", "shape": (n, width), "activations": x}
    return Verify(**fields, draft=draft) if draft else Decode(**fields)  # type: ignore[arg-type]


def raw(frame: object) -> bytes:
    return msgspec.msgpack.encode(frame)


def lane_with(*sessions: str, max_activation_bytes: int = 1 << 20) -> LaneState:
    lane = LaneState("coord", max_activation_bytes=max_activation_bytes)
    for sid in sessions:
        lane.receive(raw(Open(session=sid, model="m", layer_start=2, layer_end=4, chain=CHAIN, index=1)))
    return lane


def refused(lane: LaneState, frame: object) -> BadFrame:
    with pytest.raises(BadFrame) as err:
        lane.receive(frame if isinstance(frame, bytes) else raw(frame))
    return err.value


def test_a_batch_moves_every_session_it_holds() -> None:
    lane = lane_with("a", "b")
    lane.receive(raw(Batch(steps=[step("a", 0), step("b", 0, 3, draft=[5, 6])])))
    lane.receive(raw(Batch(steps=[step("a", 1), step("b", 2)])))  # b kept one draft of its window
    assert refused(lane, Batch(steps=[step("a", 1), step("b", 3)])).code == "out-of-order"


@pytest.mark.parametrize(("bad", "code"), [
    (Batch(steps=[step("a", 0), step("a", 1)]), "duplicate"),
    (Batch(steps=[step("a", 0), step("zz", 0)]), "not-in-plan"),  # a session this lane never opened
    (Batch(steps=[step("a", 0), step("b", 7)]), "out-of-order"),
    (Batch(steps=[step("a", 0), step("b", 0, 2)]), "bad-frame"),  # a Decode of two positions
    (Batch(steps=[step("a", 0), step("b", 0, 3, draft=[1])]), "bad-frame"),  # a window of the wrong size
    (Batch(steps=[step("a", 0), step("b", 0, rows=2)]), "bad-size"),  # more bytes than its shape
    (Batch(steps=[step("a", 0, width=4096), step("b", 0, width=4096)]), "too-large"),  # each fits, not both
])
def test_a_bad_batch_is_refused_whole_and_moves_nothing(bad: Batch, code: str) -> None:
    lane = lane_with("a", "b", max_activation_bytes=24 * 1024)
    exc = refused(lane, bad)
    assert exc.code == code
    errors = lane.refusals(exc)
    assert {e.session for e in errors} == {s.session for s in bad.steps} and all(e.code == code for e in errors)
    lane.receive(raw(Batch(steps=[step("a", 0), step("b", 0)])))  # both sessions are still where they were


def test_malformed_batches_name_their_sessions() -> None:
    lane = lane_with("a", "b")
    too_many = raw({"type": "batch", "steps": [msgspec.to_builtins(step(f"s{i}", 0)) | {"type": "decode"}
                                               for i in range(MAX_BATCH + 1)]})
    exc = refused(lane, too_many)
    assert exc.code == "bad-frame" and len(exc.sessions) == MAX_BATCH
    garbled = raw({"type": "batch", "steps": [{"type": "decode", "session": "a", "pos": "x"}, {"session": "b"}]})
    assert refused(lane, garbled).sessions == ("a", "b")
    assert refused(lane, raw({"type": "batch", "steps": []})).code == "bad-frame"
    assert refused(lane, b"\xc1").sessions == ()  # not msgpack: nothing to name, the lane answers for itself
    with pytest.raises(BadFrame):
        decode_frame(raw({"type": "batch", "steps": [{"type": "prefill", **msgspec.to_builtins(step("a", 0))}]}))


def test_bad_batches_from_a_peer_fail_only_their_sessions(tiny_model: Path) -> None:
    """Over a real lane: refused batches answer with Errors for their sessions; the stage's other
    sessions, and the chain's own requests, go on untouched."""

    async def main() -> tuple[list[int], dict[str, list[str]]]:
        chain = await make_chain(tiny_model, [0, 3, 6])
        ep = await endpoint(probe_interval=0.1)
        server = StageServer(ep)
        errors: dict[str, list[str]] = {s: [] for s in ("p", "q", "r")}
        for sid, codes in errors.items():
            server.route_replies(sid, lambda _p, f, codes=codes: codes.append(f.code) if isinstance(f, Error) else None)
        hops = [Hop(ep.node_id, addr(ep), 0, 3), chain.hops[1]]

        async def inject() -> None:
            lane = await server.pool.get(chain.hops[1].node_id, chain.hops[1].addr)
            for sid in ("p", "q"):
                await lane.send(Open(session=sid, model=MODEL, layer_start=3, layer_end=6, chain=hops, index=1))
            x = codec.encode(np.ones((2, 64), np.float32), "f32")
            for sid in ("p", "q"):
                await lane.send(Prefill(session=sid, pos=0, n_tokens=2, dtype="f32", shape=(2, 64), activations=x))
            one = codec.encode(np.ones((1, 64), np.float32), "f32")
            bad_pos = Decode(session="q", pos=9, n_tokens=1, dtype="f32", shape=(1, 64), activations=one)
            good = Decode(session="p", pos=2, n_tokens=1, dtype="f32", shape=(1, 64), activations=one)
            await lane.send(Batch(steps=[good, bad_pos]))  # refused whole: p and q each get an Error
            nan = codec.encode(np.full((1, 64), np.nan, np.float32), "f32")
            await lane.send(Batch(steps=[Decode(session="r", pos=0, n_tokens=1, dtype="f32", shape=(1, 64),
                                                activations=nan)]))  # never opened here

        try:
            tokens, _ = await asyncio.gather(
                _generate(chain), inject())
            await asyncio.sleep(0.2)
            return tokens, errors
        finally:
            server.close()
            await ep.close()
            await chain.close()

    async def _generate(chain) -> list[int]:  # type: ignore[no-untyped-def]
        return [t.token_id async for t in chain.coordinator.generate(PROMPT, max_tokens=20)]

    tokens, errors = asyncio.run(main())
    assert tokens == solo_greedy(tiny_model, PROMPT, 20)
    # the Prefills were answered with Tokens (not routed to Error lists); the batch was refused for both
    assert errors["p"] == ["out-of-order"] and errors["q"] == ["out-of-order"] and errors["r"] == ["not-in-plan"]
