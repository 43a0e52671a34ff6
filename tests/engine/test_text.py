"""The shared token-to-text rules: end tokens, stop strings, limits, split UTF-8, usage."""

from __future__ import annotations

import pytest

from meshllm.engine.base import DEFAULT_MAX_TOKENS, Finish, PromptTooLong, TextDelta, TokenLogprob
from meshllm.engine.text import TextStream, token_budget

END = 0
VOCAB = {1: b"Hel", 2: b"lo", 3: b" wor", 4: b"ld", 5: "é".encode()[:1], 6: "é".encode()[1:], 7: b"!"}


def stream(stops: tuple[str, ...] = (), limit: int = 100) -> TextStream:
    return TextStream(is_end=lambda t: t == END, token_bytes=VOCAB.__getitem__, stops=stops, limit=limit,
                      prompt_tokens=3)


def run(text: TextStream, tokens: list[int], last_at: int | None = None) -> tuple[str, Finish]:
    out = []
    for i, token in enumerate(tokens):
        delta = text.feed(token, last=i == last_at)
        if delta is not None:
            out.append(delta.text)
        if text.done:
            break
    events = text.finish()
    out += [e.text for e in events if isinstance(e, TextDelta)]
    finish = events[-1]
    assert isinstance(finish, Finish)
    return "".join(out), finish


def test_end_token_stops_and_is_not_counted() -> None:
    text, finish = run(stream(), [1, 2, END, 3])
    assert text == "Hello" and finish.reason == "stop"
    assert (finish.usage.prompt_tokens, finish.usage.completion_tokens) == (3, 2)


def test_stop_string_across_tokens_is_never_half_sent() -> None:
    s = stream(stops=("lo w",))
    sent = [s.feed(1), s.feed(2)]  # "Hel", "lo": the tail that might begin "lo w" is held back
    assert "".join(d.text for d in sent if d) == "Hel"
    assert s.feed(3) is None and s.done and s.reason == "stop"
    assert [e for e in s.finish() if isinstance(e, TextDelta)] == []


def test_held_text_is_released_when_it_cannot_become_a_stop() -> None:
    text, finish = run(stream(stops=("lox",)), [1, 2, 3, 4, END])
    assert text == "Hello world" and finish.reason == "stop"


def test_length_limit_and_last_token_end_with_length() -> None:
    text, finish = run(stream(limit=2), [1, 2, 3])
    assert text == "Hello" and finish.reason == "length" and finish.usage.completion_tokens == 2
    text, finish = run(stream(), [1, 2, 3], last_at=1)
    assert text == "Hello" and finish.reason == "length"


def test_utf8_split_across_tokens_comes_out_whole() -> None:
    s = stream()
    assert s.feed(5) is None  # half a character: nothing to send yet
    assert s.feed(6) == TextDelta("é", tokens=(5, 6))


def test_deltas_carry_every_token_fed_and_its_logprob() -> None:
    s = stream(stops=("lox",))
    lp = TokenLogprob(token_id=2, piece=b"lo", logprob=-0.5)
    deltas = [s.feed(1), s.feed(2, logprob=lp), s.feed(3), s.feed(END)]
    events = s.finish()
    sent = [d for d in deltas if d] + [e for e in events if isinstance(e, TextDelta)]
    assert [t for d in sent for t in d.tokens] == [1, 2, 3]  # "lo" was held back, then sent with " wor"
    assert [lp for d in sent for lp in d.logprobs] == [lp]
    assert "".join(d.text for d in sent) == "Hello wor"


def test_replay_moves_the_state_on_without_sending_text() -> None:
    whole, finish = run(stream(stops=("ld!",), limit=5), [1, 2, 3, 4, 7])
    s = stream(stops=("ld!",), limit=5)
    s.replay([1, 2, 3])  # "Hello wor" was sent by another engine
    assert s.generated == 3 and not s.done
    rest, resumed = run(s, [4, 7])
    assert whole == "Hello wor" and rest == ""  # "ld!" is the stop string: nothing more is sent
    assert resumed.reason == finish.reason == "stop" and resumed.usage == finish.usage


def test_replay_can_finish_the_stream() -> None:
    s = stream(limit=2)
    s.replay([1, 2, 3])
    assert s.done and s.generated == 2
    events = s.finish()
    assert events == [Finish(reason="length", usage=events[-1].usage)]  # type: ignore[union-attr]


def test_feeding_after_done_is_a_bug() -> None:
    s = stream()
    s.feed(END)
    with pytest.raises(RuntimeError):
        s.feed(1)


def test_token_budget() -> None:
    assert token_budget(10, 100, None, "m") == 90
    assert token_budget(10, 10_000, None, "m") == DEFAULT_MAX_TOKENS
    assert token_budget(10, 10_000, None, "m", default=50) == 50
    assert token_budget(10, 100, 5, "m") == 5
    assert token_budget(10, 100, 500, "m") == 90
    with pytest.raises(PromptTooLong):
        token_budget(100, 100, 5, "m")


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
OTHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


def calls_stream(reply: str, cut: int, limit: int = 1000) -> tuple[str, Finish]:
    """``reply`` fed in pieces of ``cut`` characters (one token each) to a stream that ends on a repeated call."""
    pieces = [reply[i:i + cut] for i in range(0, len(reply), cut)]
    vocab = {i + 1: p.encode() for i, p in enumerate(pieces)}
    s = TextStream(is_end=lambda t: t == END, token_bytes=vocab.__getitem__, stops=(), limit=limit, prompt_tokens=3,
                   end_on_repeated_call=True)
    return run(s, [*vocab, END])


@pytest.mark.parametrize("cut", [1, 3, 7, 1000])
def test_a_repeated_tool_call_ends_the_reply_before_it(cut: int) -> None:
    text, finish = calls_stream(f"{CALL}\n{OTHER}\n{CALL.replace(': ', ':')}\n{CALL}", cut)
    # the same call written more tightly repeats it; a newline already sent before it may stay
    assert text.rstrip("\n") == f"{CALL}\n{OTHER}" and finish.reason == "stop"
    text, finish = calls_stream(f"{CALL}\n{OTHER}", cut)
    assert text == f"{CALL}\n{OTHER}" and finish.reason == "stop"


def test_a_held_unfinished_call_is_released_at_the_length_limit() -> None:
    text, finish = calls_stream(f"{CALL}\n{CALL[:30]}", 1, limit=len(CALL) + 31)
    assert text == f"{CALL}\n{CALL[:30]}" and finish.reason == "length"


def test_tokenize_bounded_refuses_before_tokenizing_and_stops_counting_at_the_context() -> None:
    from meshllm.engine.text import PRECOUNT_CHUNK, tokenize_bounded

    counted: list[int] = []

    def count(data: bytes) -> int:
        counted.append(len(data))
        return len(data)  # one token a byte

    def whole(data: bytes) -> list[int]:
        raise AssertionError("the whole prompt must not be tokenized")

    with pytest.raises(PromptTooLong, match="cannot fit"):
        tokenize_bounded(whole, count, b"x" * 100_001, 1000, 100, "m")
    assert counted == []
    with pytest.raises(PromptTooLong, match="over"):
        tokenize_bounded(whole, count, ("word " * 20_000).encode(), 1000, 100, "m")
    assert len(counted) == 1 and counted[0] <= PRECOUNT_CHUNK  # stopped after the first chunk
    assert tokenize_bounded(lambda b: [1] * len(b), count, b"ok", 1000, 100, "m") == [1, 1]
