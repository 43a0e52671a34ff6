"""Tool calls: what a request offers (tools, ``tool_choice``), and the calls parsed out of a reply.

Models write calls in their template's convention. :class:`ToolCallParser` reads all the common
ones, as the reply streams, so it needs no knowledge of which model answered:

- **Hermes / Qwen**: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (one block per
  call; a block left open at the end of the reply is closed by it). This is also the form our
  emulation asks for and the forced-tool grammar produces.
- **Mistral**: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, and the newer
  ``[TOOL_CALLS]name[ARGS]{...}``.
- **Llama 3**: ``<|python_tag|>{"name": ..., "parameters": {...}}``, or a reply that is only such
  an object (the tag is a control token, which detokenizing usually drops).
- **Fallback**: a reply that *starts* with a JSON object ``{"name", "arguments"|"parameters"}``
  (or a JSON array of them) naming one of the offered tools is a call.

Anything else stays text, including a marker whose body is not valid JSON: nothing the model
wrote is dropped, except blank lines around calls. Text is held back only while it could still
be the start of a marker.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from meshllm.runtime.errors import BadRequest

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_OPEN, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
LLAMA3_OPEN = "<|python_tag|>"
MARKERS = (HERMES_OPEN, MISTRAL_OPEN, LLAMA3_OPEN)

Choice = Literal["auto", "none", "required"] | str
"""``auto``/``none``/``required``, or the name of the one function the model must call."""


@dataclass(frozen=True)
class Function:
    """One function a request offers, whatever the API surface called it."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})
    """JSON schema of the arguments."""
    strict: bool = False
    """Forced calls must follow the schema exactly: a keyword sampling cannot enforce is a 400."""

    def engine_tool(self) -> dict[str, Any]:
        """The OpenAI chat shape chat templates read."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolSpec:
    """The tools of one request and how they may be used."""

    functions: tuple[Function, ...]
    choice: Choice = "auto"
    parallel: bool = True

    def __post_init__(self) -> None:
        names = [f.name for f in self.functions]
        if len(set(names)) != len(names):
            raise BadRequest("tools: two tools have the same name", param="tools")
        if self.choice not in ("auto", "none", "required") and self.choice not in names:
            raise BadRequest(f"tool_choice names {self.choice!r}, which is not one of the tools", param="tool_choice")
        if self.choice != "auto" and self.choice != "none" and not self.functions:
            raise BadRequest("tool_choice requires tools", param="tool_choice")

    @property
    def active(self) -> bool:
        """The model may call tools (some are offered and ``tool_choice`` is not ``none``)."""
        return bool(self.functions) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """The model must call a tool: sampling is constrained to calls."""
        return self.active and self.choice != "auto"

    @property
    def repeats_end(self) -> bool:
        """A repeated call ends the reply: calls are forced and more than one is allowed (the grammar
        would let a model that repeats itself go on to ``max_tokens``)."""
        return self.forced and self.parallel

    def engine_tools(self) -> tuple[dict[str, Any], ...]:
        """Tools for the engine's template; none when the model may not call them."""
        return tuple(f.engine_tool() for f in self.functions) if self.active else ()

    def callable(self) -> tuple[Function, ...]:
        """The functions the forced grammar allows."""
        if self.choice in ("auto", "none", "required"):
            return self.functions
        return tuple(f for f in self.functions if f.name == self.choice)

    def parser(self) -> ToolCallParser | None:
        """A parser for the reply, or ``None`` when calls are not expected (plain text)."""
        return ToolCallParser(frozenset(f.name for f in self.functions)) if self.active else None


NO_TOOLS = ToolSpec(())


def function(name: Any, description: Any, parameters: Any, where: str, strict: Any = None) -> Function:
    """A validated :class:`Function`; ``where`` names the field in errors (``tools[0]``)."""
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise BadRequest(f"{where}: a tool name is 1-64 letters, digits, '_' or '-'", param=f"{where}.name")
    if parameters is None:
        parameters = {"type": "object"}
    if not isinstance(parameters, dict):
        raise BadRequest(f"{where}: parameters must be a JSON schema object", param=f"{where}.parameters")
    if description is not None and not isinstance(description, str):
        raise BadRequest(f"{where}: description must be a string", param=f"{where}.description")
    return Function(name=name, description=description, parameters=parameters, strict=strict is True)


# ---- parsing a reply ------------------------------------------------------------------------

@dataclass(frozen=True)
class ParsedCall:
    """A call the model made; ``arguments`` is JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class TextOut:
    """Reply text to pass on."""

    text: str


@dataclass(frozen=True)
class CallOut:
    """A complete tool call (``index`` counts the reply's calls from 0)."""

    index: int
    call: ParsedCall


ParseEvent = TextOut | CallOut


def new_call_id() -> str:
    """An id for a call, in OpenAI's style."""
    return "call_" + uuid.uuid4().hex[:24]


class JsonEnd:
    """Where a JSON object or array ends, found as the text grows: each character is scanned once."""

    def __init__(self) -> None:
        self._pos = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def scan(self, text: str, start: int) -> int | None:
        """Index just past the value that begins at ``text[start]``; ``None`` while it is not complete.

        ``text`` must extend the text of the previous call (same beginning, more at the end).
        """
        for i in range(max(self._pos, start), len(text)):
            ch = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        self._pos = len(text)
        return None


def json_value_end(text: str, start: int) -> int | None:
    """Index just past the JSON object or array that begins at ``text[start]``; ``None`` if it is not complete yet."""
    return JsonEnd().scan(text, start)


def _call(obj: Any) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of one call object, or ``None`` if it is not one."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):  # {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(name, str) or not name:
        return None
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


def parse_calls(text: str) -> list[tuple[str, str]] | None:
    """The calls a JSON text holds (an object or an array of objects), or ``None`` if it is not calls."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_call(item) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def _held_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest end of ``text`` that begins one of ``markers``."""
    return max((n for m in markers for n in range(min(len(m) - 1, len(text)), 0, -1) if text.endswith(m[:n])),
               default=0)


class ToolCallParser:
    """Splits a streamed reply into text and tool calls (sans-IO: feed text, get events)."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        """The offered tools: the bare-JSON fallback only accepts calls of these."""
        self.calls: list[ParsedCall] = []
        self._buf = ""
        self._mode: Literal["text", "hermes", "mistral", "json"] = "text"
        self._scan = JsonEnd()
        """The JSON value being read in ``mistral`` and ``json`` mode (a fresh one per value)."""
        self._searched = 0
        """How much of the buffer holds no ``</tool_call>`` (``hermes`` mode searches only past it)."""
        self._started = False
        """Some non-blank text went out: a bare JSON object can no longer be a call."""
        self._marked = False
        """The call being read began with a marker (not a bare JSON value, which may be a plain answer)."""

    def feed(self, text: str) -> list[ParseEvent]:
        """Take the next piece of the reply; return what can be passed on now."""
        self._buf += text
        return self._drain(final=False)

    def finish(self, truncated: bool = False) -> list[ParseEvent]:
        """The reply ended: everything still held, as calls or text.

        ``truncated``: it was cut by the length limit. A call it was still writing after a marker,
        or a marker's beginning, is then dropped: half a call is no text for the client.
        """
        if truncated and self._mode != "text" and self._marked:
            self._mode, self._buf = "text", ""
        elif truncated and self._mode == "text":
            self._buf = self._buf[: len(self._buf) - _held_suffix(self._buf, MARKERS)]
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[ParseEvent]:
        out: list[ParseEvent] = []
        while True:
            before = (self._mode, self._buf)
            out += self._step(final)
            if (self._mode, self._buf) == before:
                return out

    def _step(self, final: bool) -> list[ParseEvent]:
        if self._mode == "text":
            return self._text_mode(final)
        if self._mode == "hermes":
            return self._hermes(final)
        if self._mode == "mistral":
            return self._mistral(final)
        return self._json(final)

    def _text_mode(self, final: bool) -> list[ParseEvent]:
        """Pass text on, up to a marker (or a reply-opening JSON value) that may begin calls."""
        buf = self._buf
        if self.calls and not buf.strip():  # blank lines between or after calls are formatting
            if final:
                self._buf = ""
            return []
        if not self._started:
            stripped = buf.lstrip()
            at_marker = any(stripped.startswith(m) for m in MARKERS)
            if stripped and not final and not at_marker and any(m.startswith(stripped[:len(m)]) for m in MARKERS):
                return []  # "[TOOL" could still become [TOOL_CALLS]
            if stripped[:1] in ("{", "[") and not at_marker:
                self._enter("json", marked=False)
                return []
            if not stripped and not final:
                return []
        hits = [(buf.find(m), m) for m in MARKERS if m in buf]
        if hits:
            at, marker = min(hits)
            self._buf = buf[at + len(marker):]
            self._enter("hermes" if marker == HERMES_OPEN else "mistral" if marker == MISTRAL_OPEN else "json",
                        marked=True)
            before = buf[:at]
            self._started = self._started or bool(before.strip())
            return [] if self.calls and not before.strip() else self._text(before)
        keep = 0 if final else _held_suffix(buf, MARKERS)
        if self.calls and not buf[: len(buf) - keep].strip():
            keep = len(buf)  # blank text after a call waits for what follows it
        self._buf = buf[len(buf) - keep:] if keep else ""
        return self._text(buf[: len(buf) - keep])

    def _hermes(self, final: bool) -> list[ParseEvent]:
        """Inside ``<tool_call>``: wait for ``</tool_call>`` (or the end of the reply)."""
        buf = self._buf
        end = buf.find(HERMES_CLOSE, self._searched)
        if end < 0 and not final:
            self._searched = max(0, len(buf) - len(HERMES_CLOSE) + 1)
            return []
        body = buf if end < 0 else buf[:end]
        self._buf = "" if end < 0 else buf[end + len(HERMES_CLOSE):]
        self._mode = "text"
        calls = parse_calls(body.strip())
        if calls is None:
            return self._text(HERMES_OPEN + body + ("" if end < 0 else HERMES_CLOSE))
        return self._emit(calls)

    def _mistral(self, final: bool) -> list[ParseEvent]:
        buf = self._buf
        lead = buf.lstrip()
        if lead[:1] in ("[", "{"):
            start = len(buf) - len(lead)
            end = self._scan.scan(buf, start)
            if end is None and not final:
                return []
            calls = parse_calls(buf[start:end] if end is not None else "")
            if calls is None:
                self._mode, self._buf = "text", ""
                return self._text(MISTRAL_OPEN + buf)
            self._mode, self._buf = "text", buf[end:]
            return self._emit(calls)
        args_at = buf.find(MISTRAL_ARGS)
        if args_at < 0:
            if final or len(buf) > 256:  # no [ARGS] after a plausible name: not a call
                self._mode, self._buf = "text", ""
                return self._text(MISTRAL_OPEN + buf)
            return []
        name, rest = buf[:args_at].strip(), buf[args_at + len(MISTRAL_ARGS):]
        lead = rest.lstrip()
        start = len(rest) - len(lead)
        end = self._scan.scan(rest, start) if lead[:1] == "{" else None
        if end is None and not final and lead[:1] in ("", "{"):
            return []
        call = _call({"name": name, "arguments": rest[start:end]}) if end is not None else None
        if call is None or not TOOL_NAME.match(name):
            self._mode, self._buf = "text", ""
            return self._text(MISTRAL_OPEN + buf)
        self._mode, self._buf = "text", rest[end:]
        return self._emit([call])

    def _json(self, final: bool) -> list[ParseEvent]:
        """A reply (or a ``<|python_tag|>`` section) that begins with a JSON value: calls if it names offered tools."""
        buf = self._buf
        lead = buf.lstrip()
        start = len(buf) - len(lead)
        end = self._scan.scan(buf, start) if lead[:1] in ("{", "[") else None
        if end is None and not final and lead[:1] in ("", "{", "["):
            return []
        calls = parse_calls(buf[start:end]) if end is not None else None
        if calls is None or any(name not in self.names for name, _ in calls):
            self._mode, self._started, self._buf = "text", True, ""
            return self._text(buf)
        self._mode, self._buf = "text", buf[end:]
        return self._emit(calls)

    def _enter(self, mode: Literal["hermes", "mistral", "json"], marked: bool) -> None:
        self._mode, self._scan, self._searched, self._marked = mode, JsonEnd(), 0, marked

    def _text(self, text: str) -> list[ParseEvent]:
        if not text:
            return []
        self._started = self._started or bool(text.strip())
        return [TextOut(text)]

    def _emit(self, calls: Sequence[tuple[str, str]]) -> list[ParseEvent]:
        self._started = True
        out: list[ParseEvent] = []
        for name, arguments in calls:
            call = ParsedCall(id=new_call_id(), name=name, arguments=arguments)
            out.append(CallOut(len(self.calls), call))
            self.calls.append(call)
        return out
