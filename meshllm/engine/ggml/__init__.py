"""The ggml stage runtime: a contiguous range of a GGUF model's layers as ggml graphs (docs/engine.md).

``StageModel`` is the compute under layer splits; ``GgmlEngine`` serves a whole model with it
(``meshllm serve --engine ggml``) and is imported from ``meshllm.engine.ggml.engine`` so that stage
servers need not load the serving stack. The ggml libraries are llama-cpp-python's own; nothing is
loaded until a stage or a device list is asked for.
"""

from meshllm.engine.ggml.errors import StageInputError, UnsupportedModel
from meshllm.engine.ggml.memory import estimate_memory
from meshllm.engine.ggml.stage import StageModel

__all__ = ["StageInputError", "StageModel", "UnsupportedModel", "estimate_memory"]
