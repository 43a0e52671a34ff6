"""Property tests: random and mutated bytes fed to the decoders here raise only typed errors."""

from __future__ import annotations

import contextlib

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from meshllm.errors import DecodeError, VerificationError
from meshllm.identity.signing import decode_signed
from meshllm.mesh.admission import MeshKey, decode_token, encode_token, inspect_token
from meshllm.wire.frames import FrameDecoder, encode_frame

FUZZ = settings(max_examples=2000, deadline=None)


class Msg(msgspec.Struct, tag="msg"):
    a: int
    b: list[str]


VALID_FRAME = encode_frame(Msg(1, ["x", "y"]))
VALID_TOKEN = encode_token(MeshKey.generate().invite(1_800_000_000.0, bootstrap=["127.0.0.1:1"]))


@st.composite
def mutated(draw: st.DrawFn, valid: bytes) -> bytes:
    """A valid encoding with bit flips, a truncation or an extension."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(0, 4))):
        i = draw(st.integers(0, len(data) - 1))
        data[i] ^= 1 << draw(st.integers(0, 7))
    cut = draw(st.integers(0, len(data)))
    return bytes(data[:cut]) + draw(st.binary(max_size=8))


@FUZZ
@given(st.one_of(st.binary(max_size=256), mutated(VALID_FRAME)))
def test_frame_decoder_raises_only_decode_error(data: bytes) -> None:
    with contextlib.suppress(DecodeError):
        FrameDecoder(Msg, max_size=1024).feed(data)


@FUZZ
@given(st.one_of(st.binary(max_size=256), mutated(decode_token(VALID_TOKEN).invite.body)))
def test_signed_container_decoder_raises_only_decode_error(data: bytes) -> None:
    with contextlib.suppress(DecodeError):
        decode_signed(data)


@FUZZ
@given(st.one_of(st.text(max_size=300), mutated(VALID_TOKEN.encode()).map(lambda b: b.decode("latin-1"))))
def test_invite_token_decoder_raises_only_typed_errors(text: str) -> None:
    with contextlib.suppress(DecodeError, VerificationError):
        inspect_token(text)
