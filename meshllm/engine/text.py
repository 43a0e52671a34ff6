"""From sampled token ids to the API's text events: the same rules for every engine (sans-IO).

Engines sample token ids their own way (llama.cpp, the numpy runtime, a chain of stages); what the
client sees is decided here, once: where generation ends (an end-of-generation token, a stop string,
the length limit), UTF-8 characters split across tokens, stop strings never half-sent, and usage.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence

from meshllm.engine.base import Finish, FinishReason, GenerationEvent, PromptTooLong, TextDelta, Usage


def token_budget(prompt_tokens: int, context: int, max_tokens: int | None, model_id: str) -> int:
    """How many tokens may be generated: ``max_tokens`` capped by what the context has left."""
    if prompt_tokens >= context:
        raise PromptTooLong(f"prompt is {prompt_tokens} tokens; model {model_id} has a {context}-token context")
    budget = context - prompt_tokens
    return min(max_tokens, budget) if max_tokens is not None else budget


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


class TextStream:
    """One generation's text: feed it each sampled token, send what it returns, stop when ``done``."""

    def __init__(self, *, is_end: Callable[[int], bool], token_bytes: Callable[[int], bytes],
                 stops: Sequence[str], limit: int, prompt_tokens: int) -> None:
        self._is_end = is_end
        self._token_bytes = token_bytes
        self._stops = StopMatcher(stops)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._limit = limit
        self._prompt_tokens = prompt_tokens
        self.generated = 0
        """Tokens generated so far (the end-of-generation token does not count)."""
        self.reason: FinishReason = "length"
        self.done = False

    def feed(self, token: int, last: bool = False) -> TextDelta | None:
        """Take one sampled token (``last``: the sampler will send no more); return text to send now."""
        if self.done:
            raise RuntimeError("TextStream fed after it was done")
        if self._is_end(token):
            self.reason, self.done = "stop", True
            return None
        self.generated += 1
        text, hit = self._stops.feed(self._decoder.decode(self._token_bytes(token)))
        if hit:
            self.reason, self.done = "stop", True
        elif self.generated >= self._limit or last:
            self.done = True
        return TextDelta(text) if text else None

    def finish(self) -> list[GenerationEvent]:
        """The held-back tail (unless a stop string cut the text) and the closing :class:`Finish`."""
        out: list[GenerationEvent] = []
        if not self._stops.hit:
            tail = self._stops.flush(self._decoder.decode(b"", final=True))
            if tail:
                out.append(TextDelta(tail))
        out.append(Finish(reason=self.reason, usage=Usage(prompt_tokens=self._prompt_tokens,
                                                          completion_tokens=self.generated),
                          stop_sequence=self._stops.matched))
        return out
