"""The relay's sans-IO parts: choosing the next hop, and the bounds its frames are decoded under."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nacl.signing import SigningKey

from meshllm.errors import DecodeError
from meshllm.identity.keys import NodeKey
from meshllm.owner.commands import OwnerCommand, decode_command, envelope_target, seal_command
from meshllm.owner.relay import MAX_ENVELOPE, MAX_HOPS, MAX_PATH, Deliver, OwnerFrame, next_hops


def test_the_target_itself_when_connected() -> None:
    assert next_hops("a", "t", ["b", "t"], {"b": ["t"]}) == ["t"]


def test_shortest_known_paths_first_over_links_seen_from_either_end() -> None:
    links = {"a": ["b", "c", "d"], "b": ["x"], "x": ["t"], "t": ["c"], "d": []}
    # c is one hop from t (t reports the link), b two; d knows no way; e is not connected to us
    assert next_hops("a", "t", ["b", "c", "d"], links) == ["c", "b"]


def test_nodes_on_the_path_so_far_are_never_chosen_again() -> None:
    links = {"a": ["b", "c"], "b": ["t"], "c": ["b"]}
    assert next_hops("a", "t", ["b", "c"], links, avoid={"b"}) == []
    assert next_hops("a", "t", ["b", "c"], links) == ["b", "c"]


def test_no_path_no_hops() -> None:
    assert next_hops("a", "t", ["b"], {"a": ["b"], "b": ["a"]}) == []


@pytest.mark.parametrize("changes", [
    {"hops": MAX_HOPS + 1}, {"hops": -1}, {"path": ["p"] * (MAX_PATH + 1)}, {"timeout_ms": 0},
    {"envelope": b"x" * (MAX_ENVELOPE + 1)}, {"extra": 1},
])
def test_deliver_frames_out_of_bounds_are_refused_at_decode(changes: dict[str, object]) -> None:
    good = {"type": "deliver", "envelope": b"e", "target": "t", "hops": 1, "path": [], "timeout_ms": 1000}
    assert isinstance(msgspec.msgpack.decode(msgspec.msgpack.encode(good), type=OwnerFrame), Deliver)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({**good, **changes}), type=OwnerFrame)


SAMPLE = seal_command(SigningKey(b"o" * 32), NodeKey(SigningKey(b"n" * 32)).node_id, OwnerCommand(op="status"),
                      1_800_000_000.0)


@settings(max_examples=2000, deadline=None)
@given(st.one_of(
    st.binary(max_size=400),
    st.tuples(st.lists(st.tuples(st.integers(0, len(SAMPLE) - 1), st.integers(0, 255)), min_size=1, max_size=6))
    .map(lambda t: bytes(b if all(i != p for p, _ in t[0]) else next(v for p, v in t[0] if p == i)
                         for i, b in enumerate(SAMPLE))),
))
def test_a_relay_reads_envelope_targets_with_typed_errors_only(data: bytes) -> None:
    with contextlib.suppress(DecodeError):
        envelope_target(data)


@settings(max_examples=2000, deadline=None)
@given(st.one_of(
    st.binary(max_size=200),
    st.dictionaries(st.sampled_from(["op", "model", "key", "value", "timeout_s", "x"]),
                    st.one_of(st.text(max_size=5), st.floats(), st.integers(-2**63, 2**63)))
    .map(msgspec.msgpack.encode),
))
def test_command_payloads_decode_with_typed_errors_only(data: bytes) -> None:
    """What a node decodes after the signature checked out: still only DecodeError for anything wrong."""
    with contextlib.suppress(DecodeError):
        decode_command(data)
