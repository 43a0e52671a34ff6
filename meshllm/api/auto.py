"""The ``auto`` model: a request for it goes to the mesh model that fits it (a pure function).

:func:`needs_of` reads what a request needs: tools or a schema (a grammar), the context it takes
(prompt length, estimated, plus the tokens it may generate), and its task, which a cheap
deterministic classifier reads from the last user turn (``code``, ``reasoning`` or ``chat``).
:func:`choose` then picks among the mesh's models (:class:`~meshllm.runtime.backend.ModelEntry`,
which carries each model's context, template and load), in this order:

1. **Hard filters.** A request with tools or a schema goes only to a model whose chat template
   renders tools itself (others emulate them, which small models follow badly); a request goes
   only to models whose context holds it. When no model passes a filter, it is dropped and the
   reason says so (the serving engine then emulates tools, or refuses an over-long prompt).
2. **A free slot.** A model with a free slot somewhere beats one whose every slot is taken: a
   request that starts at once beats a queue.
3. **Task.** A model named for the request's task (``coder``, ``r1``/``reason``/``think``) beats
   a general one.
4. **Load.** The fewer requests running and queued per slot, the better.
5. **Size.** The smallest context that holds the request: quick questions go to small models and
   leave the long contexts free for the requests that need them.
6. **Speed.** The faster measured decode speed (tokens a second, gossiped by its nodes), then the id.

Same request and same mesh state, same choice: the tests pin the rules with a table.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from meshllm.engine.base import DEFAULT_MAX_TOKENS, ChatRequest, GenerationRequest
from meshllm.runtime.backend import ModelEntry

AUTO = "auto"
Task = Literal["code", "reasoning", "chat"]
CHARS_PER_TOKEN = 3.0
"""A conservative estimate (English runs about 4 characters a token; code and other scripts fewer)."""

_CODE = re.compile(
    r"```|\b(def|class|function|import|return|const|let|var|fn|impl|struct|public|static|void|SELECT|FROM)\b"
    r"|\b(code|coding|bug|debug|compile[sr]?|refactor|regex|stack ?trace|traceback|exception|python|javascript|"
    r"typescript|rust|golang|java|c\+\+|sql|bash|script|function|api|json|yaml|unit tests?)\b"
    r"|\.(py|js|ts|rs|go|java|cpp|c|h|rb|sh|sql)\b|[{};]\s*$", re.IGNORECASE | re.MULTILINE)
_REASONING = re.compile(
    r"\b(prove|proof|derive|step[- ]by[- ]step|reason(ing)?|logic(al)?|puzzle|riddle|solve|calculate|compute|"
    r"how many|probability|theorem|equation|integral|math(ematics)?|why does|why is|explain why)\b"
    r"|\d+\s*[-+*/^=]\s*\d+", re.IGNORECASE)
_MODEL_TASKS: tuple[tuple[Task, re.Pattern[str]], ...] = (
    ("code", re.compile(r"cod(e|er|estral|egemma)|starcoder|devstral", re.IGNORECASE)),
    ("reasoning", re.compile(r"(^|[^a-z])r1([^0-9]|$)|reason|think|qwq|(^|[^a-z])o[13]([^0-9]|$)", re.IGNORECASE)),
)


@dataclass(frozen=True)
class Needs:
    """What a request asks of the model that serves it."""

    tools: bool
    """It offers tools or constrains the output (a JSON schema or grammar)."""
    tokens: int
    """Context it may take: the prompt (estimated) plus the tokens it may generate."""
    task: Task


@dataclass(frozen=True)
class Choice:
    """The model ``auto`` stands for in one request, and why."""

    model: str
    reason: str


def classify(text: str) -> Task:
    """``code``, ``reasoning`` or ``chat`` for a user turn: keyword and shape rules, no model."""
    if _CODE.search(text):
        return "code"
    if _REASONING.search(text):
        return "reasoning"
    return "chat"


def model_task(model: str) -> Task:
    """The task a model's name says it is for (``chat`` when it says none)."""
    return next((task for task, pattern in _MODEL_TASKS if pattern.search(model)), "chat")


def needs_of(request: GenerationRequest, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> Needs:
    """What ``request`` needs (its ``model`` is not read)."""
    out = request.params.max_tokens or default_max_tokens
    if isinstance(request, ChatRequest):
        tools_text = json.dumps(list(request.tools), default=str) if request.tools else ""
        prompt = len(tools_text) + sum(len(_text(m.content)) for m in request.messages)
        text = next((_text(m.content) for m in reversed(request.messages) if m.role == "user"), "")
        tools = bool(request.tools)
    else:
        prompt = len(request.prompt) if isinstance(request.prompt, str) else int(len(request.prompt) * CHARS_PER_TOKEN)
        text = request.prompt if isinstance(request.prompt, str) else ""
        tools = False
    return Needs(tools=tools or request.params.grammar is not None,
                 tokens=int(prompt / CHARS_PER_TOKEN) + out, task=classify(text))


def _text(content: object) -> str:
    return content if isinstance(content, str) else json.dumps(content, default=str)


def choose(needs: Needs, models: Sequence[ModelEntry]) -> Choice | None:
    """The model for ``needs`` among ``models`` (None: the mesh serves none); see the module docstring."""
    pool = [m for m in models if m.id != AUTO]
    if not pool:
        return None
    why: list[str] = []
    if needs.tools:
        capable = [m for m in pool if m.tools]
        if capable:
            pool, _ = capable, why.append("tools: a template that renders tools")
        else:
            why.append("tools: no model's template renders tools (emulated)")
    fits = [m for m in pool if m.context_length is None or m.context_length >= needs.tokens]
    if fits:
        if len(fits) < len(pool):
            why.append(f"context: holds ~{needs.tokens} tokens")
        pool = fits
    else:
        pool = [max(pool, key=lambda m: (m.context_length or 0, m.id))]
        why.append(f"context: none holds ~{needs.tokens} tokens, the longest taken")

    def key(m: ModelEntry) -> tuple[bool, bool, float, int, float, str]:
        busy = m.busy / m.slots if m.slots else 0.0
        return (m.slots > 0 and m.free_slots <= 0, model_task(m.id) != needs.task, busy,
                m.context_length or 0, -m.tok_s, m.id)

    best = min(pool, key=key)
    others = [m for m in pool if m is not best]
    if others:
        runner = min(others, key=key)
        why.append(_deciding(key(best), key(runner), needs.task))
    return Choice(best.id, "; ".join(why) or "the only model")


def _deciding(best: tuple[object, ...], runner: tuple[object, ...], task: Task) -> str:
    """Which rule put the winner ahead of the runner-up, in words."""
    rules = ("load: a free slot", f"task: {task}", "load: fewer requests a slot",
             "size: the smallest context that fits", "speed: faster measured decode", "name")
    return next(rule for rule, a, b in zip(rules, best, runner, strict=True) if a != b)
