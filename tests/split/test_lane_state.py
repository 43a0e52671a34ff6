"""LaneState, the sans-IO lane core: per-session order, dtype and plan membership; probes with a passed clock."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from meshllm.split import BadFrame, Hop, codec
from meshllm.split.frames import Decode, Open, Pong, Stop, Verify
from meshllm.split.lanes import LaneState

CHAIN = [Hop("coord", "127.0.0.1:1", 0, 2), Hop("me", "127.0.0.1:2", 2, 4)]


def enc(frame: object) -> bytes:
    return msgspec.msgpack.encode(frame)


def decode(session: str, pos: int, dtype: str = "f32") -> bytes:
    x = codec.encode(np.zeros((1, 4), np.float32), dtype)
    return enc(Decode(session=session, pos=pos, n_tokens=1, dtype=dtype, shape=(1, 4), activations=x))  # type: ignore[arg-type]


def opened(peer: str = "coord") -> LaneState:
    lane = LaneState(peer)
    lane.receive(enc(Open(session="a", model="m", layer_start=2, layer_end=4, chain=CHAIN, index=1)))
    return lane


def refused(lane: LaneState, raw: bytes) -> BadFrame:
    with pytest.raises(BadFrame) as err:
        lane.receive(raw)
    return err.value


def test_steps_advance_in_order_and_errors_touch_one_session() -> None:
    lane = opened()
    lane.receive(decode("a", 0))
    assert refused(lane, decode("a", 0)).code == "out-of-order"
    assert refused(lane, decode("a", 1, "f16")).code == "bad-dtype"
    lane.receive(decode("a", 1))  # the refusals left the session where it was
    assert refused(lane, decode("b", 0)).code == "not-in-plan"
    error = lane.refusal(refused(lane, decode("b", 0)))
    assert (error.session, error.stage) == ("b", 1)


def test_open_from_a_node_outside_the_plan_is_refused() -> None:
    err = refused(LaneState("stranger"), enc(Open(session="a", model="m", layer_start=2, layer_end=4,
                                                  chain=CHAIN, index=1)))
    assert err.code == "not-in-plan" and err.session == "a"


def test_stop_forgets_the_session() -> None:
    lane = opened()
    lane.receive(enc(Stop(session="a")))
    assert lane.sessions == set()
    assert refused(lane, decode("a", 0)).code == "not-in-plan"


def test_probe_deadline() -> None:
    lane = LaneState("p")
    ping = lane.ping(now=10.0)
    assert not lane.pong(Pong(nonce=ping.nonce + 1), now=10.1)
    assert lane.pong(Pong(nonce=ping.nonce), now=10.2)
    late = lane.ping(now=20.0)
    assert not lane.pong(Pong(nonce=late.nonce), now=20.3)


def verify(session: str, pos: int, draft: list[int], n: int | None = None) -> bytes:
    n = len(draft) + 1 if n is None else n
    x = codec.encode(np.zeros((n, 4), np.float32), "f32")
    return enc(Verify(session=session, pos=pos, n_tokens=n, dtype="f32", shape=(n, 4), activations=x, draft=draft))


def test_after_a_verify_window_the_next_step_may_start_at_any_kept_length() -> None:
    lane = opened()
    lane.receive(decode("a", 0))
    lane.receive(verify("a", 1, [7, 8, 9]))  # positions 1..4; the last stage keeps 0 to 3 drafts
    assert refused(lane, decode("a", 1)).code == "out-of-order"  # the window's first token is always kept
    assert refused(lane, decode("a", 6)).code == "out-of-order"
    lane.receive(decode("a", 3))  # two kept: the next step trims positions 3 and 4
    assert refused(lane, decode("a", 3)).code == "out-of-order"  # and after a Decode, exactly one position
    lane.receive(verify("a", 4, [5]))
    lane.receive(verify("a", 6, [1, 2]))  # everything kept: the next step follows the window's end
    lane.receive(decode("a", 9))


def test_a_verify_window_must_carry_one_position_more_than_its_drafts() -> None:
    lane = opened()
    err = refused(lane, verify("a", 0, [7, 8], n=2))
    assert err.code == "bad-frame" and err.session == "a"
    lane.receive(verify("a", 0, [7, 8]))
