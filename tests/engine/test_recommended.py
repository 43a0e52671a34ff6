"""A model's recommended sampling: where it comes from, field by field, and what of a request it fills."""

from __future__ import annotations

from pathlib import Path

import pytest
from tinymodels import write_tiny_llama

from meshllm.engine.base import ChatMessage, ChatRequest, CompletionRequest, GenerationParams
from meshllm.engine.recommended import Recommended, for_model, from_gguf
from meshllm.models import resolve_model

LEFT_OUT = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty")
REC = Recommended(temperature=0.2, top_p=0.9, top_k=40, min_p=0.05, repeat_penalty=1.1, max_tokens=64,
                  system_prompt="Be brief.")


def test_fills_only_what_the_request_left_out() -> None:
    asked = GenerationParams(temperature=0.7, max_tokens=5, left_out=("top_p", "top_k", "min_p", "repeat_penalty"))
    filled = REC.fill(CompletionRequest(model="m", prompt="x", params=asked)).params
    assert (filled.temperature, filled.max_tokens) == (0.7, 5)  # set by the client: kept
    assert (filled.top_p, filled.top_k, filled.min_p, filled.repeat_penalty) == (0.9, 40, 0.05, 1.1)
    assert filled.left_out == ()

    none = REC.fill(CompletionRequest(model="m", prompt="x", params=GenerationParams(left_out=LEFT_OUT))).params
    assert (none.temperature, none.max_tokens) == (0.2, 64)
    untouched = Recommended().fill(CompletionRequest(model="m", prompt="x", params=GenerationParams(left_out=LEFT_OUT)))
    assert untouched.params == GenerationParams()  # no recommendation: OpenAI's defaults


def test_system_prompt_only_for_a_chat_without_one() -> None:
    hi = ChatMessage("user", "hi")
    chat = REC.fill(ChatRequest(model="m", messages=(hi,)))
    assert isinstance(chat, ChatRequest) and chat.messages == (ChatMessage("system", "Be brief."), hi)
    for role in ("system", "developer"):
        own = ChatRequest(model="m", messages=(ChatMessage(role, "mine"), hi))
        filled = REC.fill(own)
        assert isinstance(filled, ChatRequest) and filled.messages == own.messages


def test_gguf_keys_over_config_over_the_bundled_card(tmp_path: Path) -> None:
    keys = {"general.sampling.temp": 0.0, "general.sampling.top_k": 7, "general.sampling.min_p": 7.0}
    gguf = write_tiny_llama(tmp_path / "t.gguf", metadata=keys)
    assert from_gguf({**keys}, "t") == Recommended(temperature=0.0, top_k=7)  # min_p 7 is ignored, not fatal
    config = {"t": Recommended(temperature=1.5, top_p=0.5, max_tokens=9), "other": Recommended(top_p=0.1)}
    assert for_model(gguf, "t", config) == Recommended(temperature=0.0, top_k=7, top_p=0.5, max_tokens=9)
    assert for_model(gguf, "elsewhere", config) == Recommended(temperature=0.0, top_k=7)

    default = resolve_model("default", progress=False)
    assert for_model(default.path, default.model_id, {}) == Recommended(temperature=0.2, top_p=0.9)
    by_ref = {"default": Recommended(temperature=0.5, max_tokens=100)}
    assert for_model(default.path, default.model_id, by_ref) == Recommended(temperature=0.5, top_p=0.9,
                                                                             max_tokens=100)


@pytest.mark.parametrize("bad", [{"general.sampling.temp": float("nan")}, {"general.sampling.top_k": -1},
                                 {"general.sampling.penalty_repeat": 0.0}, {"general.sampling.top_p": "high"}])
def test_bad_gguf_values_are_skipped(bad: dict[str, object]) -> None:
    assert from_gguf(bad, "f") == Recommended()
