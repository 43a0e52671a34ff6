"""Errors of the ggml stage runtime, raised before native code could be handed something it would abort on."""

from __future__ import annotations

from meshllm.errors import MeshllmError


class UnsupportedModel(MeshllmError):
    """The GGUF (or the installed ggml) uses something this runtime does not implement or was not checked against.

    Raised while reading metadata and tensor headers, or while checking the ggml library, before any
    tensor is mapped: a node learns in milliseconds that it cannot serve a stage, and ggml never sees
    a tensor whose type or shape could trip one of its asserts (which abort the whole process).
    """

    hint = "Serve this model whole with the llama.cpp engine, or pick a llama, qwen2 or gemma3 GGUF."


class StageInputError(MeshllmError):
    """A forward call got inputs that do not fit the stage: wrong shape, position or session state."""
