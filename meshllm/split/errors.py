"""Errors of layer splits: planning failures, failed stages and bad lane frames.

:class:`StageFailed` is what a caller of a split request sees when a stage dies or stalls; it names
the stage (index in the chain and node id) so the node can mark that node suspect and replan.
"""

from __future__ import annotations

from meshllm.errors import DecodeError, MeshllmError


class SplitError(MeshllmError):
    """Base of layer-split errors."""


class NoChainFits(SplitError):
    """No chain of eligible nodes has the memory for the model; ``shortfall_bytes`` says how much is missing."""

    hint = "add a node with more free memory, raise the stage limit, or serve a smaller model"

    def __init__(self, message: str, shortfall_bytes: int) -> None:
        super().__init__(message)
        self.shortfall_bytes = shortfall_bytes


class StageFailed(SplitError):
    """Stage ``stage_index`` (on ``node_id``) failed, stalled or became unreachable during a request."""

    hint = "the node is marked suspect; retry the request so the chain is replanned without it"

    def __init__(self, stage_index: int, node_id: str, reason: str) -> None:
        super().__init__(f"split stage {stage_index} on node {node_id[:12]} failed: {reason}")
        self.stage_index = stage_index
        self.node_id = node_id
        self.reason = reason


class BadFrame(DecodeError):
    """A lane frame failed validation; ``code`` is the :class:`~meshllm.split.frames.Error` code to answer with.

    ``sessions`` are the sessions refused with it: the frame's one session, or every session a
    refused :class:`~meshllm.split.frames.Batch` names (empty when none can be read).
    """

    def __init__(self, message: str, *, code: str = "bad-frame", session: str = "",
                 sessions: tuple[str, ...] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.sessions = sessions if sessions is not None else ((session,) if session else ())
        self.session = self.sessions[0] if self.sessions else ""
