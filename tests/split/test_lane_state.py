"""LaneState, a lane's receive side: decoding within the activation limit, and probes with a passed clock.

What frames mean for their sessions is the stage core's (tests/split/test_stage_core.py)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from meshllm.split import BadFrame, codec
from meshllm.split.frames import Decode, Pong
from meshllm.split.lanes import LaneState


def test_frames_over_the_activation_limit_are_refused_naming_their_session() -> None:
    x = codec.encode(np.zeros((1, 64), np.float32), "f32")
    raw = msgspec.msgpack.encode(Decode(session="a", pos=0, n_tokens=1, dtype="f32", shape=(1, 64), activations=x))
    assert LaneState("p").receive(raw).session == "a"  # type: ignore[union-attr]
    with pytest.raises(BadFrame) as err:
        LaneState("p", max_activation_bytes=100).receive(raw)
    assert (err.value.code, err.value.session) == ("too-large", "a")


def test_probe_deadline() -> None:
    lane = LaneState("p")
    ping = lane.ping(now=10.0)
    assert not lane.pong(Pong(nonce=ping.nonce + 1), now=10.1)
    assert lane.pong(Pong(nonce=ping.nonce), now=10.2)
    late = lane.ping(now=20.0)
    assert not lane.pong(Pong(nonce=late.nonce), now=20.3)
