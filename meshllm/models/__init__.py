"""Models: references (paths, library names and ids, ``hf:``), the bundled models, GGUF metadata read
without loading weights, the content-addressed library, and transfers between nodes (docs/models.md)."""

from meshllm.models.metadata import GGUFMetadata, NotGGUF, read_metadata
from meshllm.models.refs import DEFAULT_REF, ModelNotFound, ModelRef, resolve_model

__all__ = ["DEFAULT_REF", "GGUFMetadata", "ModelNotFound", "ModelRef", "NotGGUF", "read_metadata", "resolve_model"]
