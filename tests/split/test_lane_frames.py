"""Lane frames and activation codecs: round trips, exact sizes, validation, and decoder fuzzing."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshllm.errors import DecodeError
from meshllm.split import codec
from meshllm.split.errors import BadFrame
from meshllm.split.frames import Decode, Hop, Open, Prefill, Tokens, Verify, decode_frame

FUZZ = settings(max_examples=2000, deadline=None)
CHAIN = [Hop("a", "127.0.0.1:1", 0, 2), Hop("b", "127.0.0.1:2", 2, 4)]


def step(n: int = 2, width: int = 8, dtype: str = "f32", **kw: object) -> Prefill:
    x = np.random.default_rng(0).standard_normal((n, width)).astype(np.float32)
    fields = {"session": "s1", "pos": 0, "n_tokens": n, "dtype": dtype, "shape": (n, width),
              "activations": codec.encode(x, dtype), **kw}
    return Prefill(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("dtype", "tol"), [("f32", 0.0), ("f16", 2e-3), ("i8", 1.5e-2)])
def test_codecs_round_trip_with_exact_sizes(dtype: str, tol: float) -> None:
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32) * 3
    data = codec.encode(x, dtype)
    assert len(data) == codec.encoded_size(dtype, 5, 64)
    y = codec.decode(data, dtype, 5, 64)
    assert y.dtype == np.float32 and np.abs(x - y).max() <= tol * np.abs(x).max()


def test_int8_is_about_a_quarter_of_f32() -> None:
    assert codec.encoded_size("i8", 1, 640) / codec.encoded_size("f32", 1, 640) < 0.26


def test_all_zero_rows_and_non_finite_values() -> None:
    zeros = np.zeros((2, 8), np.float32)
    assert not codec.decode(codec.encode(zeros, "i8"), "i8", 2, 8).any()
    bad = np.full((1, 2), np.nan, np.float32).tobytes()
    with pytest.raises(BadFrame, match="NaN"):
        codec.decode(bad, "f32", 1, 2)


def test_frames_round_trip() -> None:
    frames = [
        step(),
        Open(session="s1", model="m", layer_start=2, layer_end=4, chain=CHAIN, index=1, dtype="i8"),
        Tokens(session="s1", pos=3, token_ids=[7], finish="stop"),
    ]
    for frame in frames:
        assert decode_frame(msgspec.msgpack.encode(frame)) == frame


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (step(shape=(3, 8)), "bad-frame"),  # shape disagrees with n_tokens
        (step(activations=b"x" * 10), "bad-size"),
        (step(dtype="f16", activations=step().activations), "bad-size"),
        (Decode(session="s1", pos=0, n_tokens=2, dtype="f32", shape=(2, 8), activations=step().activations),
         "bad-frame"),
        (Open(session="s1", model="m", layer_start=2, layer_end=4, chain=[CHAIN[1], CHAIN[0]], index=1), "bad-frame"),
        (Open(session="s1", model="m", layer_start=0, layer_end=2, chain=CHAIN, index=1), "bad-frame"),
    ],
)
def test_invalid_frames_are_refused_with_their_session(frame: object, code: str) -> None:
    with pytest.raises(BadFrame) as err:
        decode_frame(msgspec.msgpack.encode(frame))
    assert err.value.code == code and err.value.session == "s1"


def test_activation_limit() -> None:
    with pytest.raises(BadFrame) as err:
        decode_frame(msgspec.msgpack.encode(step(n=4)), max_activation_bytes=64)
    assert err.value.code == "too-large"


def test_bad_session_ids_and_positions() -> None:
    for bad in ({"session": ""}, {"session": "a b"}, {"pos": -1}, {"pos": 1 << 30}):
        raw = msgspec.msgpack.encode(msgspec.structs.replace(step(), **bad))
        with pytest.raises(BadFrame):
            decode_frame(raw)


VALID = [msgspec.msgpack.encode(f) for f in (step(), step(dtype="i8"), Tokens(session="s", pos=1, token_ids=[1]))]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(0, 4))):
        i = draw(st.integers(0, len(data) - 1))
        data[i] ^= 1 << draw(st.integers(0, 7))
    return bytes(data[: draw(st.integers(0, len(data)))]) + draw(st.binary(max_size=8))


@FUZZ
@given(st.one_of(st.binary(max_size=300), mutated()))
def test_decoder_fuzz_raises_only_typed_errors(data: bytes) -> None:
    try:
        frame = decode_frame(data, max_activation_bytes=1 << 20)
    except DecodeError:
        return
    if isinstance(frame, Prefill | Decode):  # sizes were validated: only non-finite values can still fail
        try:
            x = codec.decode(frame.activations, frame.dtype, *frame.shape)
        except BadFrame as exc:
            assert exc.code == "bad-values"
        else:
            assert x.shape == frame.shape


def test_verify_frames_round_trip_and_bound_their_drafts() -> None:
    x = np.zeros((3, 8), np.float32)
    frame = Verify(session="s1", pos=5, n_tokens=3, dtype="f32", shape=(3, 8), activations=codec.encode(x, "f32"),
                   draft=[10, 11], compute_ms=[1.5])
    assert decode_frame(msgspec.msgpack.encode(frame)) == frame
    for bad in ({"draft": []}, {"draft": list(range(17)), "n_tokens": 18, "shape": (18, 8),
                                 "activations": codec.encode(np.zeros((18, 8), np.float32), "f32")},
                {"compute_ms": [-1.0]}, {"compute_ms": [float("nan")]}):
        with pytest.raises(BadFrame):
            decode_frame(msgspec.msgpack.encode(msgspec.structs.replace(frame, **bad)))
    reply = Tokens(session="s1", pos=7, token_ids=[10, 4], compute_ms=[1.5, 3.25])
    assert decode_frame(msgspec.msgpack.encode(reply)) == reply
