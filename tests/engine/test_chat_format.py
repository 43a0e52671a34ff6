"""Conversations rendered faithfully: family formats keep system text, tools and tool results; templates get them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from llama_cpp import Llama
from tinymodels import write_tiny_llama, write_tiny_tool_model

from meshllm.engine.base import BadChat, ChatMessage, ChatRequest, ToolCall
from meshllm.engine.chat_format import FORMATS, ChatTemplate, chat_renderer

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = ({"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": CITY}},)
ROUND_TRIP = (
    ChatMessage("system", "Be brief."),
    ChatMessage("developer", "Use metric units."),
    ChatMessage("user", "Weather in Paris?"),
    ChatMessage("assistant", "", tool_calls=(ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
    ChatMessage("tool", "18 C, sunny", tool_call_id="call_1", name="get_weather"),
)


def render(fmt: str, messages: tuple[ChatMessage, ...], tools: tuple[dict, ...] = ()) -> str:
    return ChatTemplate(fmt, family=FORMATS[fmt]).render(ChatRequest(model="m", messages=messages, tools=tools)).prompt


def test_gemma_folds_system_and_developer_text_into_the_first_user_turn() -> None:
    prompt = render("gemma", (ChatMessage("system", "Be brief."), ChatMessage("developer", "No emoji."),
                              ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello"), ChatMessage("user", "Bye")))
    assert prompt == ("<start_of_turn>user\nBe brief.\n\nNo emoji.\n\nHi<end_of_turn>\n"
                      "<start_of_turn>model\nHello<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n"
                      "<start_of_turn>model\n")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_family_format_keeps_every_message_and_tool(fmt: str) -> None:
    prompt = render(fmt, ROUND_TRIP, TOOLS)
    for text in ("Be brief.", "Use metric units.", "Weather in Paris?", "18 C, sunny", "<tool_response>",
                 '"name": "get_weather"', '"arguments": {"city": "Paris"}', "Weather now", "<tool_call>"):
        assert text in prompt, (fmt, text)
    assert prompt.index("Weather in Paris?") < prompt.index('"arguments": {"city"') < prompt.index("18 C, sunny")


def test_chatml_gives_system_and_tool_results_their_own_turns() -> None:
    prompt = render("chatml", (ChatMessage("system", "S"), ChatMessage("user", "U"),
                               ChatMessage("tool", "R", tool_call_id="c")))
    assert prompt == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
                      "<|im_start|>user\n<tool_response>\nR\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_llama2_and_mistral_put_system_text_in_the_first_instruction() -> None:
    llama2 = render("llama-2", (ChatMessage("system", "S"), ChatMessage("user", "U"), ChatMessage("assistant", "A"),
                                ChatMessage("user", "V")))
    assert llama2 == "[INST] <<SYS>>\nS\n<</SYS>>\n\nU [/INST] A </s><s>[INST] V [/INST]"
    mistral = render("mistral-instruct", (ChatMessage("system", "S"), ChatMessage("user", "U")))
    assert mistral == "[INST] S\n\nU [/INST]"


def test_system_text_after_the_last_user_turn_still_reaches_the_model() -> None:
    assert "late note" in render("gemma", (ChatMessage("user", "U"), ChatMessage("system", "late note")))


@pytest.fixture(scope="module")
def tool_template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChatTemplate]:
    path = write_tiny_tool_model(tmp_path_factory.mktemp("m") / "tools.gguf")
    vocab = Llama(str(path), vocab_only=True, verbose=False)
    from meshllm.models.metadata import read_metadata

    template, name = chat_renderer(vocab, "llama", read_metadata(path).chat_template)
    assert name == "template" and template.knows_tools
    yield template
    vocab.close()


def test_a_template_that_knows_tools_gets_tools_calls_and_results_natively(tool_template: ChatTemplate) -> None:
    prompt = tool_template.render(ChatRequest(model="m", messages=ROUND_TRIP, tools=TOOLS)).prompt
    assert "<tools>\n" + '{"type": "function", "function": {"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt
    assert "Be brief.\nUse metric units.\n" in prompt  # developer is rendered as system
    assert "You can call functions" not in prompt  # no emulation for a template with tools


def test_a_template_without_tools_gets_them_emulated(tmp_path: Path) -> None:
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    vocab = Llama(str(write_tiny_llama(tmp_path / "t.gguf")), vocab_only=True, verbose=False)
    try:
        renderer, _ = chat_renderer(vocab, "llama", template)
        prompt = renderer.render(ChatRequest(model="m", messages=ROUND_TRIP, tools=TOOLS)).prompt
    finally:
        vocab.close()
    assert not renderer.knows_tools
    assert prompt.startswith("<system>You can call functions") and '"name": "get_weather"' in prompt
    assert '<assistant><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<user><tool_response>\n18 C, sunny\n</tool_response>" in prompt


def test_a_template_that_raises_is_bad_chat(tmp_path: Path) -> None:
    template = "{{ raise_exception('roles must alternate') }}"
    vocab = Llama(str(write_tiny_llama(tmp_path / "t.gguf")), vocab_only=True, verbose=False)
    try:
        renderer, _ = chat_renderer(vocab, "llama", template)
        with pytest.raises(BadChat, match="roles must alternate"):
            renderer.render(ChatRequest(model="m", messages=(ChatMessage("user", "x"),)))
    finally:
        vocab.close()


def engine_prompt_text(engine: object, request: ChatRequest, vocab: Llama) -> str:
    tokens = engine.prompt_tokens(request)  # type: ignore[attr-defined]
    tokens = tokens[0] if isinstance(tokens, tuple) else tokens
    return bytes(vocab.detokenize(list(tokens), special=True)).decode("utf-8", "replace").replace("\u2581", " ")


def test_the_ggml_engine_renders_tool_calls_and_results(tmp_path: Path) -> None:
    import asyncio

    from meshllm.engine.ggml.engine import GgmlEngine

    path = write_tiny_tool_model(tmp_path / "tools.gguf")
    engine, vocab = GgmlEngine(path, model_id="m"), Llama(str(path), vocab_only=True, verbose=False)
    asyncio.run(engine.load())
    try:
        text = engine_prompt_text(engine, ChatRequest(model="m", messages=ROUND_TRIP, tools=TOOLS), vocab)
    finally:
        asyncio.run(engine.close())
        vocab.close()
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text and "18 C, sunny" in text


def test_the_llama_engine_renders_tool_calls_and_results(tmp_path: Path) -> None:
    import asyncio

    from meshllm.engine.llama import LlamaEngine

    path = write_tiny_tool_model(tmp_path / "tools.gguf")
    engine, vocab = LlamaEngine(path, model_id="m", n_ctx=1024, n_threads=1), Llama(str(path), vocab_only=True,
                                                                                    verbose=False)
    asyncio.run(engine.load())
    try:
        text = engine_prompt_text(engine, ChatRequest(model="m", messages=ROUND_TRIP, tools=TOOLS), vocab)
    finally:
        asyncio.run(engine.close())
        vocab.close()
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text and "18 C, sunny" in text
