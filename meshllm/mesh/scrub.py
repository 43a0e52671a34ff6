"""Scrubbing personal data out of text before it leaves this node (blackboard notes).

A note is signed by its author and copied to every member, where it stays for two days: whatever
it says cannot be taken back. Agents paste log lines, paths and configuration into notes, so the
posting node replaces what identifies a person or opens an account before signing: e-mail
addresses, secrets (API keys, tokens, private keys, ``password=...`` assignments, long random
strings) and home folders (``/home/NAME``, ``/Users/NAME``, ``C:\\Users\\NAME`` become ``~``).
Receivers cannot change a signed note, so scrubbing happens once, at the origin.
"""

from __future__ import annotations

import re

_RULES: list[tuple[re.Pattern[str], str]] = [
    # PEM blocks first: their bodies would otherwise be cut into "long random strings" piecemeal.
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|\Z)", re.S),
     "[private key]"),
    (re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"), "[email]"),
    (re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}"), r"\1 [secret]"),
    # key = value assignments of secrets (password, token, api_key, secret, ...), value dropped
    (re.compile(r"(?i)\b((?:api[_-]?key|access[_-]?key|secret|token|password|passwd|pwd|auth)"
                r"[A-Za-z0-9_-]*\s*[:=]\s*)(?!(?:bearer|basic)\s|\[secret\])(\"[^\"]*\"|'[^']*'|\S+)"),
     r"\1[secret]"),
    # well-known token shapes (OpenAI/Anthropic, GitHub, Slack, AWS, Google, Hugging Face, JWTs)
    (re.compile(r"\b(?:sk|pk|rk)-[A-Za-z0-9_-]{16,}"), "[secret]"),
    (re.compile(r"\b(?:ghp|gho|ghu|ghs|ghr|github_pat|glpat|xox[abprs]|hf)_[A-Za-z0-9_-]{16,}"), "[secret]"),
    (re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b"), "[secret]"),
    (re.compile(r"\bAIza[A-Za-z0-9_-]{30,}"), "[secret]"),
    (re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"), "[secret]"),
    # home folders: the user name goes, the rest of the path stays useful
    (re.compile(r"(?<![\w.])/(?:home|Users)/[^/\s:\"'`]+"), "~"),
    (re.compile(r"(?i)\b[A-Z]:\\Users\\[^\\\s:\"'`]+"), "~"),
    (re.compile(r"(?<![\w/])/root(?=/|\b)"), "~"),
]
_LONG_TOKEN = re.compile(r"[A-Za-z0-9+/_=-]{32,}")
"""Long unbroken strings: candidates for keys and tokens of shapes nobody listed."""


def _looks_random(text: str) -> bool:
    """Letters and digits mixed, as in keys; not a word, a path piece or a hex hash of a model file."""
    if re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}|[a-z2-7]{52}", text):
        return False  # a commit, a sha256 (model ids) or a node id: public names, not secrets
    has_digit = any(c.isdigit() for c in text)
    has_upper = any(c.isupper() for c in text)
    has_lower = any(c.islower() for c in text)
    return has_digit and (has_upper or has_lower) and sum((has_digit, has_upper, has_lower)) >= 2


def scrub(text: str) -> str:
    """``text`` with e-mail addresses, secrets and home folders replaced by placeholders."""
    for pattern, replacement in _RULES:
        text = pattern.sub(replacement, text)
    return _LONG_TOKEN.sub(lambda m: "[secret]" if _looks_random(m.group(0)) else m.group(0), text)
