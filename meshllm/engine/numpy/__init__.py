"""The numpy stage runtime: runs a contiguous range of a GGUF model's layers (see docs/engine.md).

``StageModel`` is the compute under layer splits; ``NumpyEngine`` serves a whole model with it.
``NumpyEngine`` is imported from ``meshllm.engine.numpy.engine`` so that stage servers need not load
the serving stack.
"""

from meshllm.engine.numpy.errors import StageInputError, UnsupportedModel
from meshllm.engine.numpy.memory import estimate_memory
from meshllm.engine.numpy.sampler import Sampler, SamplingParams
from meshllm.engine.numpy.stage import StageModel

__all__ = ["Sampler", "SamplingParams", "StageInputError", "StageModel", "UnsupportedModel", "estimate_memory"]
