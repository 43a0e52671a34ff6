"""Layer splits: a model too big (or too slow) for one node runs as a chain of stages (docs/splits.md).

* :mod:`.planner` (sans-IO) chooses solo or a chain ``[(node, layer_start, layer_end)]``;
* :mod:`.frames` and :mod:`.codec` are the stage-lane protocol and activation codecs;
* :mod:`.lanes` decodes a lane's frames and probes it, drives its stream, and pools lanes;
* :mod:`.stage_core` (sans-IO) is the stage side of the protocol, with the node's one session table;
* :mod:`.stage` drives it: serves a node's stages (and routes replies to its coordinators), computing
  on the node's :class:`~meshllm.compute.Runner`;
* :mod:`.coordinator_core` (sans-IO) is the pass schedule, the deadlines and the release order;
* :mod:`.coordinator` drives it: runs a split request from the first stage and streams its tokens;
* :mod:`.engine` serves a split model behind the :class:`~meshllm.engine.base.Engine` interface;
* :mod:`.control` is the ``stage-control`` protocol (a coordinator asks a worker to host a range);
* :mod:`.placement` plans from gossip, has workers host, and replans on failure;
* :mod:`.service` is a node's split side; :mod:`.routes` serves ``GET /api/plan``.

The node-side modules (engine, placement, service) are imported by the node, not here, so stage
servers and tests need not load the tokenizer stack.
"""

from meshllm.split.coordinator import SplitCoordinator, SplitToken
from meshllm.split.coordinator_core import Deadlines
from meshllm.split.errors import BadFrame, NoChainFits, SplitError, StageFailed
from meshllm.split.frames import Hop, Sampling
from meshllm.split.planner import Candidate, ModelProfile, Plan, PlannedStage, PlanOptions, Speculation, plan
from meshllm.split.stage import StageServer

__all__ = [
    "BadFrame",
    "Candidate",
    "Deadlines",
    "Hop",
    "ModelProfile",
    "NoChainFits",
    "Plan",
    "PlanOptions",
    "PlannedStage",
    "Sampling",
    "Speculation",
    "SplitCoordinator",
    "SplitError",
    "SplitToken",
    "StageFailed",
    "StageServer",
    "plan",
]
