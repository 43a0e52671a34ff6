"""How a conversation becomes a prompt, shared by every engine (llama.cpp, numpy, split).

An explicit format wins; else the GGUF's own template (Jinja, rendered as llama.cpp and
transformers render it); else our format for the model's architecture family (the bundled Gemma 3
270M has no template). Keying by family keeps every engine on the same format for the same file.

Nothing the client sent is dropped on the way:

- **system and developer messages** are kept by every format. Formats without a system turn fold
  them into the next user turn, as Gemma's own template does (``system + "\\n\\n" + user``).
- **tools, assistant tool calls and tool results** go to a template that knows tools (it refers
  to ``tools``) in the shapes transformers templates expect (``tool_calls[].function`` with the
  arguments as an object). A template or family format that knows no tools gets them *emulated*:
  the tool list is described in a system message that asks for Hermes-style calls
  (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, what the API's parser and its
  forced-tool grammar use), earlier calls are written in that form, and tool results become user
  turns wrapped in ``<tool_response>``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from meshllm.engine.base import BadChat, ChatMessage, ChatRequest, EngineError
from meshllm.models.metadata import family_of

__all__ = ["FAMILY_CHAT_FORMATS", "ChatTemplate", "RenderedChat", "chat_renderer", "family_of"]

FAMILY_CHAT_FORMATS = {"gemma": "gemma", "qwen": "chatml", "llama": "llama-2", "mistral": "mistral-instruct"}
"""Chat format for a GGUF without a template, by architecture family."""
FALLBACK_CHAT_FORMAT = "llama-2"
"""For other families: a format every tokenizer can encode."""
TEMPLATE = "template"
"""Name reported when the GGUF's own template renders the prompts."""
SYSTEM_ROLES = ("system", "developer")

TOOL_PROMPT = """You can call functions to help answer. To call one, reply with only:
<tool_call>
{{"name": "<function name>", "arguments": <the arguments as a JSON object>}}
</tool_call>
(one block per call). Results come back inside <tool_response></tool_response>.
Available functions:
{functions}"""
"""The system text that describes tools to a model whose template knows none."""


@dataclass(frozen=True)
class RenderedChat:
    """A rendered conversation: the prompt text, whether it already holds BOS, and the format's end-of-turn stops.

    The field names follow llama-cpp-python's ``ChatFormatterResponse``, which engines already read.
    """

    prompt: str
    added_special: bool
    stop: tuple[str, ...]


Format = Callable[[list[dict[str, Any]]], RenderedChat]


class ChatTemplate:
    """Renders conversations for one model: its Jinja template or a family format."""

    def __init__(self, name: str, *, family: Format | None = None, jinja: Callable[..., Any] | None = None,
                 knows_tools: bool = False) -> None:
        """One of ``family`` (our format) or ``jinja`` (llama-cpp-python's formatter of the GGUF template)."""
        assert (family is None) != (jinja is None), "a chat template is a family format or a Jinja template"
        self.name = name
        self._family = family
        self._jinja = jinja
        self.knows_tools = knows_tools and jinja is not None
        """The template renders tools itself; else they are described in a system message."""

    def render(self, request: ChatRequest) -> RenderedChat:
        """The prompt for ``request``; raises :class:`BadChat` when the template refuses the conversation."""
        return self._render([template_message(m) for m in request.messages], list(request.tools))

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> RenderedChat:
        if not self.knows_tools:
            messages = emulate_tools(messages, tools)
            tools = []
        try:
            if self._family is not None:
                return self._family(messages)
            assert self._jinja is not None
            rendered = self._jinja(messages=[_jinja_roles(m) for m in messages], tools=tools or None)
            stop = rendered.stop
            return RenderedChat(rendered.prompt, bool(rendered.added_special),
                                tuple([stop] if isinstance(stop, str) else (stop or ())))
        except BadChat:
            raise
        except Exception as exc:  # templates raise for conversations they cannot express
            raise BadChat(f"the chat template cannot render this conversation: {exc}") from exc


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it (transformers' conventions)."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                             for c in message.tool_calls]
    return out


def _arguments(text: str) -> Any:
    """Arguments as an object when they are a JSON object (templates ``tojson`` them), else the text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _jinja_roles(message: dict[str, Any]) -> dict[str, Any]:
    """``developer`` is OpenAI's newer name for ``system``; templates only know the latter."""
    return {**message, "role": "system"} if message["role"] == "developer" else message


def tool_call_text(name: str, arguments: Any) -> str:
    """One call in the Hermes form the emulation asks for."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def emulate_tools(messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with tools, tool calls and tool results written as plain text for a template without them."""
    out: list[dict[str, Any]] = []
    if tools:
        functions = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        out.append({"role": "system", "content": TOOL_PROMPT.format(functions=functions)})
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        elif message.get("tool_calls"):
            calls = [tool_call_text(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
            out.append({"role": role, "content": "\n".join([content, *calls] if content else calls)})
        else:
            out.append({"role": role, "content": content})
    return out


# ---- family formats (for GGUFs without a template) ---------------------------------------------

def _turns(messages: list[dict[str, Any]], *, system_turns: bool) -> list[tuple[str, str]]:
    """``(role, text)`` turns; without system turns, system text is folded into the next user turn."""
    turns: list[tuple[str, str]] = []
    pending: list[str] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role in SYSTEM_ROLES:
            if system_turns:
                turns.append(("system", content))
            else:
                pending.append(content)
        elif role == "user" and pending:
            turns.append(("user", "\n\n".join([*pending, content])))
            pending = []
        else:
            turns.append((role, content))
    if pending:  # system text after the last user turn still reaches the model
        turns.append(("user", "\n\n".join(pending)))
    return turns


def _merge_same_role(turns: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Formats that alternate user/assistant strictly get consecutive same-role turns joined."""
    merged: list[tuple[str, str]] = []
    for role, text in turns:
        if merged and merged[-1][0] == role:
            merged[-1] = (role, merged[-1][1] + "\n\n" + text)
        else:
            merged.append((role, text))
    return merged


def format_gemma(messages: list[dict[str, Any]]) -> RenderedChat:
    """Gemma's turns; system text folded into the next user turn, as Gemma's own template does."""
    parts = []
    for role, text in _merge_same_role(_turns(messages, system_turns=False)):
        parts.append(f"<start_of_turn>{'model' if role == 'assistant' else 'user'}\n{text}<end_of_turn>\n")
    return RenderedChat("".join(parts) + "<start_of_turn>model\n", False, ("<end_of_turn>",))


def format_chatml(messages: list[dict[str, Any]]) -> RenderedChat:
    """ChatML (Qwen and others): every role has its own turn."""
    parts = [f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in _turns(messages, system_turns=True)]
    return RenderedChat("".join(parts) + "<|im_start|>assistant\n", False, ("<|im_end|>",))


def format_llama2(messages: list[dict[str, Any]]) -> RenderedChat:
    """Llama 2 chat: ``[INST] <<SYS>>...<</SYS>> user [/INST] assistant </s><s>[INST] ...``."""
    system = "\n\n".join(m.get("content") or "" for m in messages if m["role"] in SYSTEM_ROLES)
    rest = [m for m in messages if m["role"] not in SYSTEM_ROLES]
    prompt, first, open_inst = "", True, False
    for role, text in _merge_same_role(_turns(rest, system_turns=False)):
        if role == "assistant":
            prompt += (" [/INST]" if open_inst else "") + f" {text} </s>"
            open_inst = False
            continue
        prefix = "" if first else "<s>"
        if first and system:
            text = f"<<SYS>>\n{system}\n<</SYS>>\n\n{text}"
        prompt += f"{prefix}[INST] {text}"
        first, open_inst = False, True
    if first and system:  # only system text: it still opens the conversation
        prompt = f"[INST] <<SYS>>\n{system}\n<</SYS>>\n\n"
        open_inst = True
    return RenderedChat(prompt + (" [/INST]" if open_inst else "[INST] [/INST]"), False, ("</s>",))


def format_mistral_instruct(messages: list[dict[str, Any]]) -> RenderedChat:
    """Mistral instruct: ``[INST] user [/INST]assistant</s>``; system text folded into the next user turn."""
    prompt, open_inst = "", False
    for role, text in _merge_same_role(_turns(messages, system_turns=False)):
        if role == "assistant":
            prompt += (" [/INST]" if open_inst else "") + f"{text}</s>"
            open_inst = False
        else:
            prompt += f"[INST] {text}"
            open_inst = True
    return RenderedChat(prompt + (" [/INST]" if open_inst else "[INST] [/INST]"), False, ("</s>",))


FORMATS: dict[str, Format] = {"gemma": format_gemma, "chatml": format_chatml, "llama-2": format_llama2,
                              "mistral-instruct": format_mistral_instruct}

_USES_TOOLS = re.compile(r"\btools\b")


def chat_renderer(
    llama: Any, family: str, chat_template: str | None, override: str | None = None
) -> tuple[ChatTemplate, str]:
    """The renderer for ``llama``'s model and its name: ``override``, the GGUF template, or the family's format.

    ``llama`` is a loaded ``llama_cpp.Llama`` (``vocab_only`` is enough: the template needs its BOS/EOS text).
    Raises :class:`EngineError` for an unknown ``override``.
    """
    if override is not None:
        if override not in FORMATS:
            raise EngineError(f"unknown chat format {override!r}", hint=f"choose one of {sorted(FORMATS)}")
        return ChatTemplate(override, family=FORMATS[override]), override
    if chat_template:
        from llama_cpp import llama_chat_format as fmt

        model = llama._model
        eos, bos = llama.token_eos(), llama.token_bos()
        jinja = fmt.Jinja2ChatFormatter(
            template=chat_template,
            eos_token=model.token_get_text(eos) if eos != -1 else "",
            bos_token=model.token_get_text(bos) if bos != -1 else "",
        )
        return ChatTemplate(TEMPLATE, jinja=jinja, knows_tools=bool(_USES_TOOLS.search(chat_template))), TEMPLATE
    name = FAMILY_CHAT_FORMATS.get(family, FALLBACK_CHAT_FORMAT)
    return ChatTemplate(name, family=FORMATS[name]), name

