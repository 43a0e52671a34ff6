"""Attribution against a real in-process chain: the coordinator's :class:`Auditor` recomputes, queries the
workers' signed records over real ``stage-audit`` streams and names the stage that forged, wherever it is
in the chain; a worker that keeps no record is named as unaccountable; an honest chain passes."""

from __future__ import annotations

import asyncio
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from nacl.signing import SigningKey
from split_helpers import MODEL, PROMPT, addr

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "security"))

from forger import _forged_forward
from net.net_helpers import endpoint

from meshllm.engine.ggml import StageModel
from meshllm.split import Hop, SplitCoordinator, StageServer
from meshllm.split.audit import Recorder
from meshllm.split.auditor import Auditor, FinishedRequest, serve_records
from meshllm.split.frames import Sampling

pytestmark = pytest.mark.timeout(120)


@dataclass
class Placement:
    """What the auditor needs of a placement: the model, its file, names, and where evictions go."""

    path: Path
    evicted: list[tuple[list[str], str]] = field(default_factory=list)

    @property
    def engine(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(model_id=MODEL)

    @property
    def ref(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(path=self.path)

    def names(self) -> dict[str, str]:
        return {}

    def evict(self, _coordinator: SplitCoordinator, nodes: list[str], reason: str) -> None:
        self.evicted.append((list(nodes), reason))


async def audit_chain(path: Path, forge_at: int | None, *, records: bool = True, sampling: Sampling | None = None
                      ) -> tuple[object, list[Hop], Placement]:
    """Run one request over a 3-stage chain whose stage ``forge_at`` forges, then audit it."""
    bounds = [0, 2, 4, 6]
    keys = [SigningKey.generate() for _ in range(3)]
    eps = [await endpoint(key, probe_interval=0.1) for key in keys]
    servers = [StageServer(ep) for ep in eps]
    hops = [Hop(ep.node_id, addr(ep), a, b) for ep, a, b in zip(eps, bounds, bounds[1:], strict=False)]
    try:
        for i, (server, hop, key) in enumerate(zip(servers[1:], hops[1:], keys[1:], strict=True), start=1):
            stage = StageModel.load(path, hop.layer_start, hop.layer_end, max_context=256, threads=1)
            if i == forge_at:
                stage.forward = types.MethodType(_forged_forward, stage)  # type: ignore[method-assign]
            server.host(MODEL, stage)
            if records:
                server.recorder = Recorder()
                serve_records(server.endpoint, server.recorder, key)
        first = StageModel.load(path, 0, 2, max_context=256, threads=1)
        coordinator = SplitCoordinator(servers[0], MODEL, first, hops, speculate="off")
        sampling = sampling or Sampling()
        tokens = [t.token_id async for t in coordinator.generate(PROMPT, max_tokens=12, sampling=sampling,
                                                                 session="audited")]
        placement = Placement(path)
        auditor = Auditor(eps[0], rate=1.0)
        verdict = await auditor.audit(placement, coordinator, FinishedRequest("audited", PROMPT, tokens, sampling))
        assert auditor.status(MODEL)["run"] == 1
        await auditor.close()
        return verdict, hops, placement
    finally:
        for server in servers:
            server.close()
        for ep in eps:
            await ep.close()


@pytest.mark.parametrize("forge_at", [1, 2])
def test_the_forging_stage_is_named(tiny_model: Path, forge_at: int) -> None:
    verdict, hops, placement = asyncio.run(audit_chain(tiny_model, forge_at))
    assert verdict is not None and verdict.kind == "forged" and verdict.stages == (forge_at,), verdict
    assert placement.evicted == [([hops[forge_at].node_id], f"forged: {verdict.reason}")]


def test_stages_without_records_are_unaccountable(tiny_model: Path) -> None:
    verdict, hops, placement = asyncio.run(audit_chain(tiny_model, 2, records=False))
    assert verdict is not None and verdict.kind == "unaccountable" and verdict.stages == (1, 2)
    assert placement.evicted[0][0] == [hops[1].node_id, hops[2].node_id]


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.8, top_k=40, seed=11)])
def test_an_honest_chain_passes(tiny_model: Path, sampling: Sampling) -> None:
    verdict, _hops, placement = asyncio.run(audit_chain(tiny_model, None, sampling=sampling))
    assert verdict is None and placement.evicted == []
