"""Shared helpers of the split tests: real QUIC endpoints on 127.0.0.1 hosting stages of a tiny model."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from nacl.signing import SigningKey

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tinymodels, net helpers

from net.net_helpers import endpoint

from meshllm.engine.base import SamplingParams
from meshllm.engine.ggml import StageModel
from meshllm.engine.sampler import Sampler
from meshllm.models.bulk import BulkServer
from meshllm.net import Endpoint
from meshllm.split import Hop, SplitCoordinator, StageServer
from meshllm.split.tcp_lane import LaneDialer, TcpStream

MODEL = "tiny"
PROMPT = [1, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]


@dataclass
class Chain:
    """A coordinator plus stage servers, each on its own endpoint."""

    endpoints: list[Endpoint]
    servers: list[StageServer]
    hops: list[Hop]
    coordinator: SplitCoordinator
    bulk: list[BulkServer] = field(default_factory=list)
    """Each node's bulk channel, when its lanes may ride TLS over TCP."""
    keys: list[SigningKey] = field(default_factory=list)
    """The nodes' signing keys, in chain order."""

    async def close(self) -> None:
        for server in self.servers:
            server.close()
        for bulk in self.bulk:
            await bulk.close()
        for ep in self.endpoints:
            await ep.close()


def addr(ep: Endpoint) -> str:
    host, port = ep.local_addr
    return f"{host}:{port}"


async def make_chain(path: Path, bounds: list[int], *, max_context: int = 256,
                     bulk_ports: Callable[[dict[str, int]], Callable[[str], int]] | None = None,
                     probe_interval: float = 0.1, **coord_kwargs: object) -> Chain:
    """Stages [bounds[i], bounds[i+1]) on one endpoint each (one thread); stage 0 is the coordinator.
    Endpoints probe every ``probe_interval`` s (a stage silent for 3 of them is suspect).

    With ``bulk_ports``, every node also runs a bulk channel (TLS on TCP) that serves lanes, and its
    lanes dial the ports ``bulk_ports(listening)`` names (``listening``: node id -> the real port).
    """
    keys = [SigningKey.generate() for _ in bounds[1:]]
    eps = [await endpoint(key, probe_interval=probe_interval) for key in keys]
    listening: dict[str, int] = {}
    ports = bulk_ports(listening) if bulk_ports is not None else None
    servers = [StageServer(ep, dial=LaneDialer(key, ports) if ports else None)
               for ep, key in zip(eps, keys, strict=True)]
    bulk = []
    if ports is not None:
        for ep, key, server in zip(eps, keys, servers, strict=True):
            channel = BulkServer(key, lambda _: None, lambda peer, ep=ep: peer in ep.peers)
            channel.on_lane = lambda r, w, peer, server=server: server.serve_lane(TcpStream(r, w), peer)
            listening[ep.node_id] = await channel.start("127.0.0.1")
            bulk.append(channel)
    hops = [Hop(ep.node_id, addr(ep), a, b) for ep, a, b in zip(eps, bounds, bounds[1:], strict=False)]
    for server, hop in zip(servers[1:], hops[1:], strict=True):
        server.host(MODEL, StageModel.load(path, hop.layer_start, hop.layer_end, max_context=max_context, threads=1))
    first = StageModel.load(path, 0, bounds[1], max_context=max_context, threads=1)
    coord = SplitCoordinator(servers[0], MODEL, first, hops, **coord_kwargs)  # type: ignore[arg-type]
    return Chain(eps, servers, hops, coord, bulk, keys)


def solo_greedy(path: Path, prompt: list[int], n: int, max_context: int = 256) -> list[int]:
    """Greedy tokens of the whole model in one stage, decoded one by one (the reference).

    Rows are computed as a chain's stages compute them: a lone row as it would be in a batch.
    """
    stage = StageModel.load(path, max_context=max_context, threads=1)
    stage.batch_exact()
    sampler = Sampler(SamplingParams(temperature=0.0))
    history = list(prompt)
    logits = stage.forward("s", np.asarray(prompt), 0, last_only=True)
    out: list[int] = []
    for _ in range(n):
        token = sampler(logits[-1], history)
        out.append(token)
        history.append(token)
        logits = stage.forward("s", np.asarray([token]), len(history) - 1, last_only=True)
    stage.close()
    return out
