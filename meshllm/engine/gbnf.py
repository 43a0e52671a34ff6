"""A GBNF grammar checker that runs before llama.cpp ever sees the grammar.

llama.cpp's grammar parser reports most mistakes, but not all of them safely: in the build we ship,
a repetition whose minimum exceeds its maximum (``"a"{2,1}``) makes it expand rules until the
process is killed, and large repetition counts expand into as many rules. A grammar can come from
any client or peer, so this module parses the same syntax (llama.cpp's ``grammars/README.md``:
rules ``name ::= alternatives``, literals, character classes, ``.``, groups, ``* + ?`` and
``{m}``, ``{m,}``, ``{m,n}``, ``#`` comments) and refuses, with a message naming the place, what
llama.cpp would reject or choke on: syntax errors, undefined rules, a missing ``root``, bad
escapes, repetition bounds out of order or over :data:`MAX_REPEAT`, and grammars whose expansion
would exceed :data:`MAX_EXPANDED`. Left recursion is left to llama.cpp, which detects it safely.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from meshllm.engine.base import InvalidRequest

MAX_GRAMMAR_CHARS = 64 * 1024
"""Longer grammars are refused (a JSON schema's grammar is a few KB)."""
MAX_REPEAT = 1000
"""Largest repetition count accepted in ``{m,n}``."""
MAX_EXPANDED = 200_000
"""Upper bound on grammar elements after llama.cpp expands repetitions into rules."""

_NAME = re.compile(r"[a-zA-Z0-9-]+")
_ESCAPES = {"n", "r", "t", "\\", '"', "[", "]"}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}


class BadGrammar(InvalidRequest):
    """A grammar that is not valid GBNF or that llama.cpp could not safely compile."""

    hint = "check the grammar's syntax (llama.cpp GBNF, start rule 'root')"


@dataclass
class _Rules:
    defined: dict[str, int] = field(default_factory=dict)
    """Rule name -> expanded size of its body."""
    referenced: dict[str, int] = field(default_factory=dict)
    """Rule name -> offset of its first reference (for the error message)."""


class _Parser:
    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0
        self.rules = _Rules()

    def fail(self, what: str) -> BadGrammar:
        line = self.s.count("\n", 0, self.i) + 1
        col = self.i - (self.s.rfind("\n", 0, self.i) + 1) + 1
        return BadGrammar(f"grammar: {what} at line {line}, column {col}")

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def space(self, newlines: bool) -> None:
        """Skip blanks and comments; newlines too inside groups (llama.cpp's ``is_nested``)."""
        while self.i < len(self.s):
            c = self.s[self.i]
            if c in " \t" or (newlines and c in "\r\n"):
                self.i += 1
            elif c == "#":
                while self.i < len(self.s) and self.s[self.i] not in "\r\n":
                    self.i += 1
            else:
                return

    def name(self) -> str:
        m = _NAME.match(self.s, self.i)
        if m is None:
            raise self.fail("expected a rule name")
        self.i = m.end()
        return m.group()

    def grammar(self) -> None:
        self.space(True)
        while self.i < len(self.s):
            start = self.i
            rule = self.name()
            self.space(False)
            if not self.s.startswith("::=", self.i):
                raise self.fail(f"expected '::=' after rule name {rule!r}")
            self.i += 3
            self.space(True)
            size = self.alternates(nested=False)
            if self.i < len(self.s) and self.peek() not in "\r\n":
                raise self.fail(f"unexpected {self.peek()!r}")
            if rule in self.rules.defined:
                self.i = start
                raise self.fail(f"rule {rule!r} is defined twice")
            self.rules.defined[rule] = size
            self.space(True)

    def alternates(self, nested: bool) -> int:
        size = self.sequence(nested)
        while self.peek() == "|":
            self.i += 1
            self.space(True)
            size += self.sequence(nested) + 1
        return size

    def sequence(self, nested: bool) -> int:
        total = 0
        last: int | None = None  # expanded size of the last item (what a postfix repeats)
        while self.i < len(self.s):
            c = self.peek()
            if c == '"':
                self.i += 1
                n = 0
                while self.peek() != '"':
                    if not self.peek():
                        raise self.fail("unterminated string literal")
                    self.char()
                    n += 1
                self.i += 1
                last = max(n, 1)
            elif c == "[":
                self.i += 1
                if self.peek() == "^":
                    self.i += 1
                n = 0
                while self.peek() != "]":
                    if not self.peek():
                        raise self.fail("unterminated character class")
                    self.char()
                    if self.peek() == "-" and self.s[self.i + 1: self.i + 2] not in ("]", ""):
                        self.i += 1
                        self.char()
                    n += 1
                self.i += 1
                last = n + 1
            elif _NAME.match(c):
                at = self.i
                self.rules.referenced.setdefault(self.name(), at)
                last = 1
            elif c == "(":
                self.i += 1
                self.space(True)
                last = self.alternates(nested=True)
                if self.peek() != ")":
                    raise self.fail("expected ')'")
                self.i += 1
            elif c == ".":
                self.i += 1
                last = 1
            elif c in "*+?":
                if last is None:
                    raise self.fail(f"{c!r} with nothing before it to repeat")
                self.i += 1
                total += 2  # the item (counted once already) moves into a rule of its own, plus a reference
                last = None
            elif c == "{":
                if last is None:
                    raise self.fail("'{' with nothing before it to repeat")
                low, high = self.bounds()
                total += last * max(low, high or 0, 1) + 2 * last
                if total > MAX_EXPANDED:
                    raise self.fail(f"repetitions expand past {MAX_EXPANDED} grammar elements")
                last = None
            else:
                break
            if last is not None:
                total += last
            self.space(nested)
        if total > MAX_EXPANDED:
            raise self.fail(f"repetitions expand past {MAX_EXPANDED} grammar elements")
        return total

    def bounds(self) -> tuple[int, int | None]:
        """``{m}``, ``{m,}`` or ``{m,n}`` at the cursor: ``(m, n)`` with ``None`` for no maximum."""
        start = self.i
        self.i += 1
        self.space(False)
        low = self.integer()
        self.space(False)
        high: int | None = low
        if self.peek() == ",":
            self.i += 1
            self.space(False)
            high = self.integer() if self.peek().isdigit() else None
            self.space(False)
        if self.peek() != "}":
            raise self.fail("expected '}' to close a repetition")
        end, self.i = self.i + 1, start
        if high is not None and low > high:
            raise self.fail(f"repetition {{{low},{high}}} has its minimum above its maximum")
        if max(low, high or 0) > MAX_REPEAT:
            raise self.fail(f"repetition count over {MAX_REPEAT}")
        self.i = end
        return low, high

    def integer(self) -> int:
        m = re.compile(r"[0-9]{1,9}").match(self.s, self.i)
        if m is None:
            raise self.fail("expected a repetition count")
        self.i = m.end()
        return int(m.group())

    def char(self) -> None:
        """One character of a literal or class, escapes included."""
        if self.peek() != "\\":
            self.i += 1
            return
        self.i += 1
        esc = self.peek()
        if esc in _HEX_ESCAPES:
            digits = self.s[self.i + 1: self.i + 1 + _HEX_ESCAPES[esc]]
            if len(digits) != _HEX_ESCAPES[esc] or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"bad \\{esc} escape")
            if int(digits, 16) > 0x10FFFF:
                raise self.fail("escape beyond U+10FFFF")
            self.i += 1 + len(digits)
        elif esc in _ESCAPES:
            self.i += 1
        else:
            raise self.fail(f"unknown escape \\{esc or 'end'}")


def check_grammar(text: str) -> bytes:
    """``text`` encoded for llama.cpp, or :class:`BadGrammar` naming what is wrong with it."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise BadGrammar(f"grammar is {len(text)} characters; the limit is {MAX_GRAMMAR_CHARS}")
    if "\0" in text:
        raise BadGrammar("grammar contains a NUL character")
    try:
        encoded = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadGrammar(f"grammar is not valid UTF-8 text ({exc.reason})") from None
    parser = _Parser(text)
    parser.grammar()
    rules = parser.rules
    if "root" not in rules.defined:
        raise BadGrammar("grammar has no 'root' rule (generation starts there)")
    for name, at in rules.referenced.items():
        if name not in rules.defined:
            parser.i = at
            raise parser.fail(f"rule {name!r} is used but never defined")
    if sum(rules.defined.values()) > MAX_EXPANDED:
        raise BadGrammar(f"grammar expands past {MAX_EXPANDED} elements")
    return encoded
