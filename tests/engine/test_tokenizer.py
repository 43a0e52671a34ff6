"""The tokenizer is llama.cpp's: same ids, round trips, end markers and the Gemma chat format."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshllm.engine.base import ChatMessage, ChatRequest
from meshllm.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer(gemma_model: Path) -> Tokenizer:
    return Tokenizer(gemma_model, "gemma3", chat_template=None)


def test_ids_and_round_trip(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("Hello world") == [2, 9259, 1902]
    text = "Zürich: 3 × 4 = 12 🙂"
    assert tokenizer.decode(tokenizer.encode(text, add_bos=False)) == text
    assert b"".join(tokenizer.token_bytes(t) for t in tokenizer.encode(text, add_bos=False)) == text.encode()


def test_end_of_generation(tokenizer: Tokenizer) -> None:
    assert tokenizer.is_end(1)  # <eos>
    assert not tokenizer.is_end(9259)


def test_gemma_chat_format_without_a_template(tokenizer: Tokenizer) -> None:
    request = ChatRequest(model="m", messages=(ChatMessage("user", "Hi"),))
    tokens, stops = tokenizer.request_prompt(request, "m", 4096)
    [start_of_turn] = tokenizer.encode("<start_of_turn>", add_bos=False, special=True)
    assert tokens.count(start_of_turn) == 2  # the markers are control tokens, not text
    assert tokenizer.decode(tokens) == "user\nHi\nmodel\n"  # decoding leaves control tokens out
    assert tokens[0] == 2 and tokens.count(2) == 1  # exactly one BOS
    assert stops
