"""The lane fields of grammars and logprobs: ``Sampling.grammar/generated/logprobs`` and ``Tokens.logprobs``.

A peer can send anything, so each field has a cap that decoding enforces, and what msgspec cannot
express (counts that must agree, finite logprobs) is checked by :func:`validate`; every failure is a
:class:`BadFrame` naming the session, never an exception from deeper down.
"""

from __future__ import annotations

import math

import msgspec
import pytest

from meshllm.engine.gbnf import MAX_GRAMMAR_CHARS
from meshllm.engine.sampler import MAX_LOGPROBS
from meshllm.split.errors import BadFrame
from meshllm.split.frames import Hop, Open, Sampling, TokenLogprobs, Tokens, decode_frame

CHAIN = [Hop("a", "127.0.0.1:1", 0, 2), Hop("b", "127.0.0.1:2", 2, 4)]


def open_frame(**sampling: object) -> Open:
    return Open(session="s1", model="m", layer_start=2, layer_end=4, chain=CHAIN, index=1, max_context=64,
                sampling=Sampling(**sampling))  # type: ignore[arg-type]


def tokens(ids: list[int], logprobs: list[TokenLogprobs]) -> Tokens:
    return Tokens(session="s1", pos=3, token_ids=ids, logprobs=logprobs)


def roundtrip(frame: object) -> object:
    return decode_frame(msgspec.msgpack.encode(frame))


def test_grammar_and_logprob_fields_round_trip() -> None:
    frame = open_frame(grammar='root ::= "a"', generated=[5, 6], logprobs=MAX_LOGPROBS)
    assert roundtrip(frame) == frame
    reply = tokens([7, 8], [TokenLogprobs(-0.5, [(7, -0.5), (9, -1.5)]), TokenLogprobs(0.0)])
    decoded = roundtrip(reply)
    assert isinstance(decoded, Tokens) and decoded.logprobs[0].top == [(7, -0.5), (9, -1.5)]
    assert roundtrip(tokens([7], [])) == tokens([7], [])  # no logprobs asked: none sent


@pytest.mark.parametrize(("frame", "what"), [
    (open_frame(grammar="x" * (MAX_GRAMMAR_CHARS + 1)), "Expected `str` of length"),
    (open_frame(grammar=""), "Expected `str` of length"),
    (open_frame(logprobs=MAX_LOGPROBS + 1), f"Expected `int` <= {MAX_LOGPROBS}"),
    (open_frame(logprobs=-1), "Expected `int` >= 0"),
    (open_frame(generated=[-1]), "Expected `int` >= 0"),
    (open_frame(generated=list(range(64))), "do not fit a 64-token context"),
    (tokens([1], [TokenLogprobs(-1.0, [(2, -1.0)] * (MAX_LOGPROBS + 1))]), "length <= 20"),
    (tokens([1, 2], [TokenLogprobs(-1.0)]), "1 logprobs for 2 tokens"),
    (tokens([1], [TokenLogprobs(math.nan)]), "not a finite number"),
    (tokens([1], [TokenLogprobs(-1.0, [(2, math.inf)])]), "not a finite number"),
    (tokens([1], [TokenLogprobs(0.25)]), "not a finite number <= 0"),
    (tokens([1], [TokenLogprobs(-1.0, [(-3, -1.0)])]), "Expected `int` >= 0"),
], ids=["grammar-too-long", "grammar-empty", "too-many-logprobs", "negative-logprobs", "bad-generated-id",
        "generated-beyond-context", "too-many-top", "count-mismatch", "nan", "inf", "positive", "bad-top-id"])
def test_bad_fields_are_bad_frames_naming_the_session(frame: object, what: str) -> None:
    with pytest.raises(BadFrame, match=what) as info:
        roundtrip(frame)
    assert info.value.session == "s1"


@pytest.mark.parametrize("raw", [
    {"type": "open", "session": "s1", "sampling": {"grammar": 5}},
    {"type": "open", "session": "s1", "sampling": {"logprobs": "3"}},
    {"type": "tokens", "session": "s1", "pos": 1, "token_ids": [1], "logprobs": [[-1.0, [[1]]]]},
    {"type": "tokens", "session": "s1", "pos": 1, "token_ids": [1], "logprobs": [{"logprob": -1.0}]},
    {"type": "tokens", "session": "s1", "pos": 1, "token_ids": [1], "logprobs": [["x"]]},
])
def test_malformed_fields_are_refused(raw: dict[str, object]) -> None:
    with pytest.raises(BadFrame) as info:
        decode_frame(msgspec.msgpack.encode(raw))
    assert info.value.session == "s1"
