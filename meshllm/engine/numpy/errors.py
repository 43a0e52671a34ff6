"""Errors of the numpy stage runtime, raised before any work is wasted on a model it cannot run."""

from __future__ import annotations

from meshllm.errors import MeshllmError


class UnsupportedModel(MeshllmError):
    """The GGUF uses an architecture, tensor type or feature the numpy runtime does not implement.

    Raised while reading metadata and tensor headers, before any weight is dequantized, so a node
    learns in milliseconds (not after minutes of dequantizing) that it cannot serve a stage.
    """

    hint = "Serve this model whole with the llama.cpp engine, or pick a llama, qwen2 or gemma3 GGUF."


class StageInputError(MeshllmError):
    """A forward call got inputs that do not fit the stage: wrong shape, position or session state."""
