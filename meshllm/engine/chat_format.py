"""How chat messages become a prompt, shared by every engine (llama.cpp, numpy, split).

An explicit format wins; else the GGUF's own template (Jinja); else the known llama-cpp-python
format of the model's architecture family (the default Gemma 3 270M has no template, and
llama-cpp-python's generic fallback makes it answer with nothing). Keying by family keeps every
engine on the same format for the same file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshllm.engine.base import EngineError
from meshllm.models.metadata import family_of

__all__ = ["FAMILY_CHAT_FORMATS", "chat_renderer", "family_of"]

FAMILY_CHAT_FORMATS = {"gemma": "gemma", "qwen": "chatml", "llama": "llama-2", "mistral": "mistral-instruct"}
"""Chat format (llama-cpp-python's names) for a GGUF without a template, by architecture family."""
FALLBACK_CHAT_FORMAT = "llama-2"
"""For other families: llama-cpp-python's own fallback, which every tokenizer can encode."""
TEMPLATE = "template"
"""Name reported when the GGUF's own template renders the prompts."""


def chat_renderer(
    llama: Any, family: str, chat_template: str | None, override: str | None = None
) -> tuple[Callable[..., Any], str]:
    """The renderer for ``llama``'s model and its name: ``override``, the GGUF template, or the family's format.

    ``llama`` is a loaded ``llama_cpp.Llama`` (``vocab_only`` is enough: the template needs its BOS/EOS text).
    Raises :class:`EngineError` for an unknown ``override``.
    """
    from llama_cpp import llama_chat_format as fmt

    formats: dict[str, Callable[..., Any]] = {
        "gemma": fmt.format_gemma, "chatml": fmt.format_chatml, "llama-2": fmt.format_llama2,
        "mistral-instruct": fmt.format_mistral_instruct,
    }
    if override is not None:
        if override not in formats:
            raise EngineError(f"unknown chat format {override!r}", hint=f"choose one of {sorted(formats)}")
        return formats[override], override
    if chat_template:
        model = llama._model
        eos, bos = llama.token_eos(), llama.token_bos()
        renderer = fmt.Jinja2ChatFormatter(
            template=chat_template,
            eos_token=model.token_get_text(eos) if eos != -1 else "",
            bos_token=model.token_get_text(bos) if bos != -1 else "",
        )
        return renderer, TEMPLATE
    name = FAMILY_CHAT_FORMATS.get(family, FALLBACK_CHAT_FORMAT)
    return formats[name], name
