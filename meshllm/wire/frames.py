"""Length-prefixed msgpack frames of msgspec structs (sans-IO).

A frame is a big-endian ``u32`` length followed by that many bytes of msgpack. Every stream has a
cap: a length above it is refused *before* the body is buffered, so a peer cannot make us hold
more than the cap. Decoding is incremental (:class:`FrameDecoder` takes whatever bytes arrived and
returns whole messages) and every failure is one :class:`~meshllm.errors.DecodeError`.
Message sets are msgspec tagged unions, so the first frame of a stream can name its kind.
"""

from __future__ import annotations

import struct
from typing import Any, Generic, TypeVar

import msgspec

from meshllm.errors import DecodeError, FrameTooLarge

T = TypeVar("T")

HEADER = struct.Struct(">I")
CONTROL_FRAME_MAX = 8 * 1024 * 1024
"""Cap for control streams (gossip, request tunnels, admission)."""

_encoder = msgspec.msgpack.Encoder()


def encode_frame(message: Any, max_size: int = CONTROL_FRAME_MAX) -> bytes:
    """One frame holding ``message``; refuses to build a frame the receiver would refuse."""
    body = _encoder.encode(message)
    if len(body) > max_size:
        raise FrameTooLarge(f"frame of {len(body)} bytes exceeds the {max_size}-byte cap")
    return HEADER.pack(len(body)) + body


class FrameDecoder(Generic[T]):
    """Incremental decoder for one stream's frames.

    After an error the decoder is poisoned (the stream is out of sync); the caller closes the
    stream. Nothing is returned from a ``feed`` that raised, so no half-decoded state leaks.
    """

    def __init__(self, type_: Any, max_size: int = CONTROL_FRAME_MAX) -> None:
        self._decoder = msgspec.msgpack.Decoder(type_)
        self._max = max_size
        self._buf = bytearray()
        self._failed: DecodeError | None = None
        self.completed = 0
        """Frames decoded so far: tells a caller when the partial frame it watches has ended."""

    @property
    def buffered(self) -> int:
        """Bytes held waiting for the rest of a frame."""
        return len(self._buf)

    def pending_size(self) -> int | None:
        """Whole wire size (header included) of the partial frame, once its length prefix is in."""
        if len(self._buf) < HEADER.size:
            return None
        return HEADER.size + HEADER.unpack_from(self._buf)[0]

    def clear(self) -> None:
        """Drop buffered bytes and refuse further input (the stream was reset)."""
        self._buf = bytearray()
        if self._failed is None:
            self._failed = DecodeError("stream was reset")

    def feed(self, data: bytes) -> list[T]:
        """Add received bytes; return every message completed by them, in order."""
        if self._failed is not None:
            raise self._failed
        self._buf += data
        out: list[T] = []
        while len(self._buf) >= HEADER.size:
            (length,) = HEADER.unpack_from(self._buf)
            if length > self._max:
                self._failed = FrameTooLarge(f"peer announced a {length}-byte frame; cap is {self._max}")
                raise self._failed
            end = HEADER.size + length
            if len(self._buf) < end:
                break
            body = bytes(self._buf[HEADER.size:end])
            del self._buf[:end]
            self.completed += 1
            try:
                out.append(self._decoder.decode(body))
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, RecursionError) as exc:
                self._failed = DecodeError(f"malformed frame: {exc}")
                raise self._failed from exc
        return out

    def at_boundary(self) -> bool:
        """True when no partial frame is buffered (a clean place for the stream to end)."""
        return not self._buf


def decode_frame(data: bytes, type_: Any, max_size: int = CONTROL_FRAME_MAX) -> Any:
    """Decode exactly one whole frame; trailing or missing bytes are a :class:`DecodeError`."""
    decoder: FrameDecoder[Any] = FrameDecoder(type_, max_size)
    messages = decoder.feed(data)
    if len(messages) != 1 or not decoder.at_boundary():
        raise DecodeError(f"expected exactly one frame, got {len(messages)} and {decoder.buffered} extra bytes")
    return messages[0]
