"""Frame codec: round trips, incremental feeding, caps, and one typed error for every bad input."""

from __future__ import annotations

import msgspec
import pytest

from meshllm.errors import DecodeError, FrameTooLarge
from meshllm.wire.frames import HEADER, FrameDecoder, decode_frame, encode_frame


class Ping(msgspec.Struct, tag="ping"):
    nonce: int


class Data(msgspec.Struct, tag="data"):
    payload: bytes


Message = Ping | Data


def test_round_trip_of_a_tagged_union() -> None:
    frames = encode_frame(Ping(7)) + encode_frame(Data(b"x" * 1000))
    assert FrameDecoder(Message).feed(frames) == [Ping(7), Data(b"x" * 1000)]


def test_byte_at_a_time_feeding_yields_each_message_once() -> None:
    data = encode_frame(Ping(1)) + encode_frame(Ping(2))
    decoder: FrameDecoder[Message] = FrameDecoder(Message)
    out = []
    for i in range(len(data)):
        out += decoder.feed(data[i:i + 1])
    assert out == [Ping(1), Ping(2)] and decoder.at_boundary()


def test_announced_length_over_cap_refused_before_buffering() -> None:
    decoder: FrameDecoder[Message] = FrameDecoder(Message, max_size=100)
    with pytest.raises(FrameTooLarge):
        decoder.feed(HEADER.pack(101))
    with pytest.raises(FrameTooLarge):
        decoder.feed(encode_frame(Ping(1)))  # poisoned: the stream is out of sync


def test_encoder_refuses_frames_over_cap() -> None:
    with pytest.raises(FrameTooLarge):
        encode_frame(Data(b"x" * 200), max_size=100)


BAD_BODIES = [b"\xc1", b"\x81\xa4type\xa4nope", b"\x92\x01\x02", msgspec.msgpack.encode({"type": "ping"})]


@pytest.mark.parametrize("body", BAD_BODIES)
def test_malformed_bodies_are_decode_errors(body: bytes) -> None:
    with pytest.raises(DecodeError):
        FrameDecoder(Message).feed(HEADER.pack(len(body)) + body)


def test_decode_frame_requires_exactly_one_frame() -> None:
    assert decode_frame(encode_frame(Ping(3)), Message) == Ping(3)
    with pytest.raises(DecodeError):
        decode_frame(encode_frame(Ping(3)) + b"\x00", Message)
    with pytest.raises(DecodeError):
        decode_frame(encode_frame(Ping(3))[:-1], Message)
