"""The model families the ggml stage runtime runs: one module each, listed in :data:`REGISTRY`.

A family module defines its :class:`~meshllm.engine.ggml.family.Family` as ``FAMILY``: what it reads
from the GGUF beyond the shared keys, its tensors per layer, and its block graph (llama.cpp's
``src/models/<arch>.cpp``). Adding a family is its module and one line here.
"""

from __future__ import annotations

from meshllm.engine.ggml.errors import UnsupportedModel
from meshllm.engine.ggml.families import (
    deepseek2,
    ernie4_5,
    ernie4_5_moe,
    gemma2,
    gemma3,
    glm4moe,
    gpt_oss,
    granite,
    llama,
    mistral3,
    olmo2,
    phi3,
    qwen2,
    qwen2moe,
    qwen3,
    qwen3moe,
    smollm3,
)
from meshllm.engine.ggml.family import Family

REGISTRY: dict[str, Family] = {f.arch: f for f in (
    llama.FAMILY,
    qwen2.FAMILY,
    qwen2moe.FAMILY,
    qwen3.FAMILY,
    qwen3moe.FAMILY,
    gemma2.FAMILY,
    gemma3.FAMILY,
    phi3.FAMILY,
    mistral3.FAMILY,
    olmo2.FAMILY,
    smollm3.FAMILY,
    granite.FAMILY,
    ernie4_5.FAMILY,
    ernie4_5_moe.FAMILY,
    gpt_oss.FAMILY,
    glm4moe.FAMILY,
    deepseek2.FAMILY,
)}
"""Architecture (``general.architecture``) -> its family."""


def family_for(arch: str) -> Family:
    """The family of ``arch``; an architecture not in the registry is refused, naming the supported ones."""
    family = REGISTRY.get(arch)
    if family is None:
        raise UnsupportedModel(
            f"architecture {arch!r} is not supported by the ggml stage runtime "
            f"(supported: {', '.join(sorted(REGISTRY))})"
        )
    return family
