"""From sampled token ids to the API's text events: the same rules for every engine (sans-IO).

Engines sample token ids their own way (llama.cpp, the numpy runtime, a chain of stages); what the
client sees is decided here, once: where generation ends (an end-of-generation token, a stop string,
the length limit), UTF-8 characters split across tokens, stop strings never half-sent, and usage.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Sequence

from meshllm.engine.base import (
    DEFAULT_MAX_TOKENS,
    Finish,
    FinishReason,
    GenerationEvent,
    PromptTooLong,
    TextDelta,
    TokenLogprob,
    Usage,
)


def token_budget(prompt_tokens: int, context: int, max_tokens: int | None, model_id: str, *,
                 default: int = DEFAULT_MAX_TOKENS) -> int:
    """How many tokens may be generated: ``max_tokens`` (else ``default``) capped by what the context has left."""
    if prompt_tokens >= context:
        raise PromptTooLong(f"prompt is {prompt_tokens} tokens; model {model_id} has a {context}-token context")
    return min(max_tokens if max_tokens is not None else default, context - prompt_tokens)


PRECOUNT_CHUNK = 16 * 1024
"""Prompts longer than two of these are counted chunk by chunk before the whole is tokenized."""


def tokenize_bounded(tokenize: Callable[[bytes], list[int]], count: Callable[[bytes], int], data: bytes,
                     context: int, longest_token: int, model_id: str) -> list[int]:
    """``tokenize(data)``, with work bounded by the context rather than by the prompt.

    A prompt of ``n`` bytes has at least ``n / longest_token`` tokens, so one that cannot fit is refused
    before any tokenizing; a long one is first counted in chunks (``count``, cut at whitespace or a
    character boundary), stopping as soon as the context is exceeded. llama.cpp's tokenizers slow down
    sharply on long runs without spaces: 3.6 MB of rare Unicode took minutes (issue 29). A chunk
    boundary moves the count by about a token, which the stop allows for; the exact count is the
    whole prompt's, checked by :func:`token_budget`.
    """
    if len(data) > context * longest_token:
        raise PromptTooLong(f"prompt is {len(data)} bytes; at most {longest_token} bytes a token, it cannot fit "
                            f"model {model_id}'s {context}-token context")
    if len(data) > 2 * PRECOUNT_CHUNK:
        counted = chunks = 0
        start = 0
        while start < len(data):
            end = _chunk_end(data, start)
            counted += count(data[start:end])
            chunks += 1
            start = end
            if counted > context + chunks:
                raise PromptTooLong(f"prompt is over {counted - chunks} tokens after {start} of its {len(data)} "
                                    f"bytes; model {model_id} has a {context}-token context")
    return tokenize(data)


def _chunk_end(data: bytes, start: int) -> int:
    """End of the chunk from ``start``: after the last whitespace of the next :data:`PRECOUNT_CHUNK`
    bytes, else at the last UTF-8 character start, else at the chunk's size."""
    end = start + PRECOUNT_CHUNK
    if end >= len(data):
        return len(data)
    space = max(data.rfind(b" ", start, end), data.rfind(b"\n", start, end))
    if space > start:
        return space + 1
    cut = end
    while cut > start and data[cut] & 0xC0 == 0x80:
        cut -= 1
    return cut if cut > start else end


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back what might begin one.

    Text that could be the start of a stop string is not sent until the next piece shows it is
    not, so a client never sees half of a stop sequence.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.hit = False
        self.matched: str | None = None
        """The stop string found (the earliest in the text)."""
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add generated text; return what may be sent now and whether a stop string was found."""
        buf = self._held + text
        cut, matched = min(((i, s) for s, i in ((s, buf.find(s)) for s in self.stops) if i >= 0), default=(-1, None))
        if cut >= 0:
            self.hit, self.matched = True, matched
            self._held = ""
            return buf[:cut], True
        keep = max((n for s in self.stops for n in range(min(len(s) - 1, len(buf)), 0, -1)
                    if buf.endswith(s[:n])), default=0)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self, text: str = "") -> str:
        """At the end of generation: everything still held (it can no longer become a stop)."""
        out = self._held + text
        self._held = ""
        return out


CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
"""The markup of a call as the forced-tool grammar writes it (``meshllm/api/grammar.py``)."""


class RepeatedCallStop:
    """Ends a reply at a tool call identical to one it already made.

    A forced ``tool_choice`` with parallel calls allowed is a grammar of one or more
    ``<tool_call>`` blocks; a small model, free to add calls, repeats the first one until
    ``max_tokens``. Here each block is held until its ``</tool_call>``: one whose call (name and
    arguments, compared as JSON) was already made ends the reply before it, unsent, as a stop
    string would; any other is sent on. Text outside blocks passes through.
    """

    def __init__(self) -> None:
        self.hit = False
        self._held = ""
        self._seen: set[str] = set()

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return what may be sent now and whether a repeated call ended the reply."""
        buf, out = self._held + text, []
        while (start := buf.find(CALL_OPEN)) >= 0:
            end = buf.find(CALL_CLOSE, start)
            if end < 0:
                break
            end += len(CALL_CLOSE)
            key = _call_key(buf[start + len(CALL_OPEN): end - len(CALL_CLOSE)])
            if key is not None and key in self._seen:
                self.hit, self._held = True, ""
                return "".join(out) + buf[:start].rstrip("\n"), True
            if key is not None:
                self._seen.add(key)
            out.append(buf[:end])
            buf = buf[end:]
        start = buf.find(CALL_OPEN)
        keep = len(buf) - start if start >= 0 else max(
            (n for n in range(min(len(CALL_OPEN) - 1, len(buf)), 0, -1) if buf.endswith(CALL_OPEN[:n])), default=0)
        self._held = buf[len(buf) - keep:] if keep else ""
        out.append(buf[: len(buf) - keep])
        return "".join(out), False

    def flush(self) -> str:
        """At the end of generation: what is still held (an unfinished block)."""
        out, self._held = self._held, ""
        return out


def _call_key(body: str) -> str | None:
    """A call block's JSON, canonical (keys sorted), or ``None`` when it is not JSON."""
    try:
        return json.dumps(json.loads(body), sort_keys=True)
    except ValueError:
        return None


class TextStream:
    """One generation's text: feed it each sampled token, send what it returns, stop when ``done``.

    Every delta carries the token ids fed since the previous one (and their logprobs when given),
    so that a stream's deltas together hold its whole continuation: what a replacement engine needs
    to resume it (:meth:`replay`).
    """

    def __init__(self, *, is_end: Callable[[int], bool], token_bytes: Callable[[int], bytes],
                 stops: Sequence[str], limit: int, prompt_tokens: int, end_on_repeated_call: bool = False) -> None:
        """``end_on_repeated_call``: end at a tool call the reply already made (:class:`RepeatedCallStop`)."""
        self._is_end = is_end
        self._token_bytes = token_bytes
        self._stops = StopMatcher(stops)
        self._calls = RepeatedCallStop() if end_on_repeated_call else None
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._limit = limit
        self._prompt_tokens = prompt_tokens
        self._tokens: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self.generated = 0
        """Tokens generated so far (the end-of-generation token does not count)."""
        self.cached_tokens = 0
        """Prompt tokens the engine took from its prompt cache (reported in usage)."""
        self.reason: FinishReason = "length"
        self.done = False

    @property
    def remaining(self) -> int:
        """Tokens that may still be generated (the length limit less what was)."""
        return self._limit - self.generated

    def feed(self, token: int, last: bool = False, logprob: TokenLogprob | None = None) -> TextDelta | None:
        """Take one sampled token (``last``: the sampler will send no more); return text to send now."""
        if self.done:
            raise RuntimeError("TextStream fed after it was done")
        if self._is_end(token):
            self.reason, self.done = "stop", True
            return None
        self.generated += 1
        self._tokens.append(token)
        if logprob is not None:
            self._logprobs.append(logprob)
        text, hit = self._stops.feed(self._decoder.decode(self._token_bytes(token)))
        if self._calls is not None and not self._calls.hit:
            text, repeated = self._calls.feed(text)
            hit = hit or repeated
        if hit:
            self.reason, self.done = "stop", True
        elif self.generated >= self._limit or last:
            self.done = True
        return self._delta(text) if text else None

    def replay(self, tokens: Sequence[int]) -> None:
        """Feed tokens another engine already generated and sent (failover): the state moves on as if
        they had been sampled here, and none of their text is sent again."""
        for token in tokens:
            if self.done:
                break
            self.feed(token)
        self._tokens.clear()
        self._logprobs.clear()

    def _delta(self, text: str, final: bool = False) -> TextDelta:
        delta = TextDelta(text, tokens=tuple(self._tokens), logprobs=tuple(self._logprobs), final=final)
        self._tokens.clear()
        self._logprobs.clear()
        return delta

    def finish(self) -> list[GenerationEvent]:
        """The held-back tail (unless a stop string cut the text) and the closing :class:`Finish`.

        The tail's delta carries the tokens fed since the last one; after a stop string they are
        dropped with its text (the generation is over: nothing will resume it).
        """
        out: list[GenerationEvent] = []
        tail = "" if self._stops.hit else self._stops.flush(self._decoder.decode(b"", final=True))
        if self._calls is not None:
            tail = "" if self._calls.hit else self._calls.feed(tail)[0] + self._calls.flush()
        if tail or (self._tokens and not self._stops.hit and not (self._calls and self._calls.hit)):
            out.append(self._delta(tail, final=True))
        out.append(Finish(reason=self.reason, usage=Usage(prompt_tokens=self._prompt_tokens,
                                                          completion_tokens=self.generated,
                                                          cached_tokens=self.cached_tokens),
                          stop_sequence=self._stops.matched))
        return out
