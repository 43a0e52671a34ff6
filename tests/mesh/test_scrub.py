"""Scrubbing personal data out of blackboard notes."""

from __future__ import annotations

import pytest

from meshllm.mesh.scrub import scrub


@pytest.mark.parametrize(("text", "expected"), [
    ("ask ana.lopez+ml@mail.example.co.uk", "ask [email]"),
    ("ran /home/alice/src/meshllm/run.sh", "ran ~/src/meshllm/run.sh"),
    ("at /Users/Bob Smith and /root/.cache", "at ~ Smith and ~/.cache"),
    (r"see C:\Users\carol\AppData", r"see ~\AppData"),
    ("OPENAI_API_KEY=sk-proj-abcDEF0123456789xyz", "OPENAI_API_KEY=[secret]"),
    ('password: "hunter2 is here"', "password: [secret]"),
    ("Authorization: Bearer abcdefgh12345678", "Authorization: Bearer [secret]"),
    ("curl -H 'x: Bearer abcdefgh12345678'", "curl -H 'x: Bearer [secret]'"),
    ("token ghp_0123456789abcdefABCDEF0123", "token [secret]"),
    ("aws AKIAIOSFODNN7EXAMPLE", "aws [secret]"),
    ("hf_AbCdEfGhIjKlMnOpQrStUv", "[secret]"),
    ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXk\n-----END OPENSSH PRIVATE KEY-----", "[private key]"),
    ("random Zx8kP2mQ9vL4nR7tY1wB5cD3fG6hJ0sA", "random [secret]"),
])
def test_personal_data_is_replaced(text: str, expected: str) -> None:
    assert scrub(text) == expected


@pytest.mark.parametrize("text", [
    "STATUS: serving gemma-3-270m at 42 tok/s on /srv/models/x.gguf",
    "model 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 is loaded",
    "node ydqzjmtkq3xvrbmfmdj3cgx5pdnoxmvfqsgmqmwbn3dxkyxoqlmq joined",
    "DONE: commit 3a4440e1b2c3d4e5f60718293a4b5c6d7e8f9012 merged",
    "a_very_long_identifier_name_without_digits_at_all",
])
def test_ordinary_text_is_left_alone(text: str) -> None:
    assert scrub(text) == text
