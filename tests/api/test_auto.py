"""The ``auto`` model's choice (a pure function): what a request needs, and the model each rule picks."""

from __future__ import annotations

import pytest

from meshllm.api.auto import Needs, choose, classify, model_task, needs_of
from meshllm.engine.base import ChatMessage, ChatRequest, CompletionRequest, GenerationParams
from meshllm.runtime.backend import ModelEntry

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def model(mid: str, context: int = 4096, *, tools: bool = False, slots: int = 4, free: int = 4, busy: int = 0,
          tok_s: float = 0.0) -> ModelEntry:
    return ModelEntry(id=mid, nodes=("n",), context_length=context, tools=tools, slots=slots, free_slots=free,
                      busy=busy, tok_s=tok_s)


SMALL = model("small-chat", 2048)
BIG = model("big-chat", 32768)
TOOLS = model("tool-model", 8192, tools=True)
CODER = model("qwen-coder", 8192)
R1 = model("deepseek-r1-distill", 8192)


@pytest.mark.parametrize(("needs", "models", "chosen", "why"), [
    (Needs(False, 100, "chat"), [BIG, SMALL, TOOLS], "small-chat", "size: the smallest context"),
    (Needs(True, 100, "chat"), [BIG, SMALL, TOOLS], "tool-model", "tools: a template that renders tools"),
    (Needs(True, 100, "chat"), [BIG, SMALL], "small-chat", "tools: no model's template renders tools (emulated)"),
    (Needs(False, 5000, "chat"), [BIG, SMALL, TOOLS], "tool-model", "context: holds ~5000 tokens"),
    (Needs(False, 20000, "chat"), [BIG, SMALL, TOOLS], "big-chat", "context: holds ~20000 tokens"),
    (Needs(False, 99999, "chat"), [BIG, SMALL], "big-chat", "none holds ~99999 tokens, the longest taken"),
    (Needs(True, 20000, "chat"), [BIG, SMALL, TOOLS], "tool-model", "context: none holds"),
    (Needs(False, 100, "code"), [SMALL, CODER, R1], "qwen-coder", "task: code"),
    (Needs(False, 100, "reasoning"), [SMALL, CODER, R1], "deepseek-r1-distill", "task: reasoning"),
    (Needs(False, 100, "chat"), [SMALL, CODER, R1], "small-chat", "task: chat"),
    # load: a model with no free slot loses to any with one, whatever else holds
    (Needs(False, 100, "chat"), [model("small-chat", 2048, free=0, busy=4), BIG], "big-chat", "load: a free slot"),
    (Needs(False, 100, "code"), [model("qwen-coder", free=0, busy=6), SMALL], "small-chat", "load: a free slot"),
    # fewer requests a slot before size; then speed between equals
    (Needs(False, 100, "chat"), [model("small-chat", 2048, busy=2), BIG], "big-chat", "load: fewer requests a slot"),
    (Needs(False, 100, "chat"), [model("a", tok_s=20.0), model("b", tok_s=45.0)], "b", "speed"),
    (Needs(False, 100, "chat"), [model("b"), model("a")], "a", "name"),
    (Needs(False, 100, "chat"), [SMALL], "small-chat", "the only model"),
])
def test_the_choice_table(needs: Needs, models: list[ModelEntry], chosen: str, why: str) -> None:
    choice = choose(needs, models)
    assert choice is not None and choice.model == chosen and why in choice.reason, choice
    assert choose(needs, list(reversed(models))) == choice  # the order of the listing does not matter


def test_no_model_no_choice_and_auto_is_never_chosen() -> None:
    assert choose(Needs(False, 1, "chat"), []) is None
    assert choose(Needs(False, 1, "chat"), [model("auto")]) is None


@pytest.mark.parametrize(("text", "task"), [
    ("Why is the sky blue?", "reasoning"),
    ("Fix this Python traceback: KeyError in foo.py", "code"),
    ("```js\nconst x = 1;\n```", "code"),
    ("def f(x): return x", "code"),
    ("What is 17 * 23?", "reasoning"),
    ("Prove that there are infinitely many primes", "reasoning"),
    ("Tell me a story about a cat", "chat"),
    ("hello", "chat"),
])
def test_the_classifier(text: str, task: str) -> None:
    assert classify(text) == task


def test_model_names_say_their_task() -> None:
    assert [model_task(m) for m in ("Qwen2.5-Coder-7B", "codestral-22b", "DeepSeek-R1-Distill", "QwQ-32B",
                                    "gemma-3-270m", "o3-mini", "llama-3.1-8b", "r10-chat")] == \
        ["code", "code", "reasoning", "reasoning", "chat", "reasoning", "chat", "chat"]


def test_needs_of_a_request() -> None:
    chat = ChatRequest(model="auto", messages=(ChatMessage("system", "x" * 300), ChatMessage("user", "write a regex")),
                       params=GenerationParams(max_tokens=50))
    assert needs_of(chat) == Needs(False, (300 + 13) // 3 + 50, "code")
    with_tools = ChatRequest(model="auto", messages=(ChatMessage("user", "hi"),), tools=(TOOL,))
    assert needs_of(with_tools).tools and needs_of(with_tools).task == "chat"
    schema = CompletionRequest(model="auto", prompt="a b", params=GenerationParams(grammar='root ::= "x"'))
    assert needs_of(schema, default_max_tokens=10) == Needs(True, 1 + 10, "chat")
