"""Model references, the bundled default model, and GGUF metadata read without loading weights."""

from meshllm.models.metadata import GGUFMetadata, NotGGUF, read_metadata
from meshllm.models.refs import DEFAULT_REF, ModelNotFound, ModelRef, resolve_model

__all__ = ["DEFAULT_REF", "GGUFMetadata", "ModelNotFound", "ModelRef", "NotGGUF", "read_metadata", "resolve_model"]
