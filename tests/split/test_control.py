"""The stage-control protocol over real QUIC endpoints: hosting by model id with a signed manifest (the worker
fetches its range), and who may host, re-place and release a stage."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import numpy as np
import pytest
from nacl.signing import SigningKey
from split_helpers import MODEL, addr, endpoint

from meshllm.models.gguf_file import GGUFFile
from meshllm.models.library import Library
from meshllm.models.manifest import build_manifest, sign_manifest
from meshllm.models.store import ModelStore
from meshllm.net import Endpoint
from meshllm.split.control import (
    MAX_STAGES_PER_MEMBER,
    Host,
    Hosted,
    HostRefused,
    Release,
    StageHost,
    Warm,
    Warmed,
    ask,
)
from meshllm.split.frames import Hop
from meshllm.split.stage import StageServer


class Node:
    def __init__(self, key: SigningKey, ep: Endpoint, library: Library) -> None:
        self.key, self.ep, self.library = key, ep, library
        self.store = ModelStore(library, ep, key, list, lambda *a, **k: None)

    @property
    def id(self) -> str:
        return self.ep.node_id


async def node(tmp: Path, name: str) -> Node:
    key = SigningKey.generate()
    return Node(key, await endpoint(key), Library(tmp / name / "models"))


def host_request(coord: Node, worker: Node, manifest_key: SigningKey, model_id: str, manifest: bytes | None = None,
                 bounds: tuple[int, int] = (2, 6), model: str = MODEL) -> Host:
    chain = [Hop(coord.id, addr(coord.ep), 0, bounds[0]), Hop(worker.id, addr(worker.ep), *bounds)]
    return Host(model=model, model_id=model_id, manifest=manifest or b"", chain=chain, index=1, max_context=64)


def test_worker_fetches_its_range_then_only_the_coordinator_controls_it(tiny_model: Path, tmp_path: Path) -> None:
    async def main() -> None:
        coord, worker, other = [await node(tmp_path, n) for n in ("coord", "worker", "other")]
        entry = coord.library.add(tiny_model, source="file", owned=False)
        manifest = build_manifest(tiny_model)
        signed = sign_manifest(coord.key, manifest)
        server = StageServer(worker.ep)
        changes: list[str] = []
        host = StageHost(server, worker.store, budget=1 << 30, on_change=changes.append)
        request = host_request(coord, worker, coord.key, entry.id, signed)
        try:
            hosted = await ask(coord.ep, worker.id, addr(worker.ep), request)
            assert isinstance(hosted, Hosted) and (hosted.layer_start, hosted.layer_end) == (2, 6)
            assert hosted.fetched_bytes > 0 and changes == [MODEL]
            (stored,) = worker.library.entries()
            assert stored.kind == "stage" and stored.layers == (2, 6)
            names = {t.name for t in GGUFFile(stored.file).tensors}
            assert not any(n.startswith(("blk.0.", "blk.1.")) for n in names) and "output.weight" in names
            # the same request again (a replan that kept this range) reuses the stage: nothing fetched
            again = await ask(coord.ep, worker.id, addr(worker.ep), request)
            assert isinstance(again, Hosted) and again.fetched_bytes == 0
            # another member may neither release nor re-place the coordinator's stage
            with pytest.raises(HostRefused, match="no stage"):
                await ask(other.ep, worker.id, addr(worker.ep), Release(model=MODEL))
            with pytest.raises(HostRefused, match="coordinator its chain starts with"):
                await ask(other.ep, worker.id, addr(worker.ep), request)
            forged = host_request(other, worker, other.key, entry.id, signed)  # its own chain, coord's manifest
            with pytest.raises(HostRefused, match="signed by another key"):
                await ask(other.ep, worker.id, addr(worker.ep), forged)
            assert (coord.id, MODEL) in host.hosted
            await ask(coord.ep, worker.id, addr(worker.ep), Release(model=MODEL))
            assert not host.hosted
        finally:
            server.close()
            for n in (coord, worker, other):
                await n.ep.close()

    asyncio.run(main())


def test_stages_per_member_and_the_memory_budget_are_bounded(tiny_model: Path, tmp_path: Path) -> None:
    async def main() -> None:
        coord, worker = [await node(tmp_path, n) for n in ("coord", "worker")]
        entry = coord.library.add(tiny_model, source="file", owned=False)
        signed = sign_manifest(coord.key, build_manifest(tiny_model))
        server = StageServer(worker.ep)
        host = StageHost(server, worker.store, budget=1 << 30)
        try:
            for i in range(MAX_STAGES_PER_MEMBER):
                await ask(coord.ep, worker.id, addr(worker.ep), host_request(coord, worker, coord.key, entry.id,
                                                                              signed, model=f"m{i}"))
            with pytest.raises(HostRefused, match="per member"):
                await ask(coord.ep, worker.id, addr(worker.ep), host_request(coord, worker, coord.key, entry.id,
                                                                              signed, model="one-more"))
            host.budget = 1
            with pytest.raises(HostRefused, match="MiB free"):
                await ask(coord.ep, worker.id, addr(worker.ep),
                          host_request(coord, worker, coord.key, entry.id, signed, bounds=(1, 6), model="m0"))
            assert host.hosted[(coord.id, "m0")].layers == (2, 6)  # the refused re-placement left it as it was
        finally:
            server.close()
            for n in (coord, worker):
                await n.ep.close()

    asyncio.run(main())


def test_a_hosted_stage_opens_sessions_only_for_its_placed_chain(tiny_model: Path, tmp_path: Path) -> None:
    """The stage server side of the rule: an Open whose chain differs from the placed one is refused."""
    from split_helpers import PROMPT

    from meshllm.split import SplitCoordinator
    from meshllm.split.errors import StageFailed

    async def main() -> None:
        coord, worker = [await node(tmp_path, n) for n in ("coord", "worker")]
        entry = coord.library.add(tiny_model, source="file", owned=False)
        signed = sign_manifest(coord.key, build_manifest(tiny_model))
        coord_server, worker_server = StageServer(coord.ep), StageServer(worker.ep)
        StageHost(worker_server, worker.store, budget=1 << 30)
        request = host_request(coord, worker, coord.key, entry.id, signed)
        from meshllm.engine.ggml import StageModel

        first = StageModel.load(tiny_model, 0, 2, max_context=64)
        try:
            await ask(coord.ep, worker.id, addr(worker.ep), request)
            good = SplitCoordinator(coord_server, MODEL, first, request.chain)
            tokens = [t.token_id async for t in good.generate(PROMPT, max_tokens=4)]
            assert len(tokens) == 4
            moved = [request.chain[0], msgspec.structs.replace(request.chain[1], addr="127.0.0.1:9")]
            bad = SplitCoordinator(coord_server, MODEL, first, moved)
            with pytest.raises(StageFailed, match="placed this stage for"):
                _ = [t async for t in bad.generate(PROMPT, max_tokens=2)]
        finally:
            first.close()
            coord_server.close()
            worker_server.close()
            for n in (coord, worker):
                await n.ep.close()
        assert np.all(np.asarray(tokens) >= 0)

    asyncio.run(main())


def test_the_mesh_owner_may_release_any_members_stage(tiny_model: Path, tmp_path: Path) -> None:
    async def main() -> None:
        coord, worker, owner, other = [await node(tmp_path, n) for n in ("coord", "worker", "owner", "other")]
        entry = coord.library.add(tiny_model, source="file", owned=False)
        signed = sign_manifest(coord.key, build_manifest(tiny_model))
        server = StageServer(worker.ep)
        host = StageHost(server, worker.store, budget=1 << 30, is_owner=lambda n: n == owner.id)
        try:
            await ask(coord.ep, worker.id, addr(worker.ep), host_request(coord, worker, coord.key, entry.id, signed))
            with pytest.raises(HostRefused, match="no stage"):
                await ask(other.ep, worker.id, addr(worker.ep), Release(model=MODEL))
            await ask(owner.ep, worker.id, addr(worker.ep), Release(model=MODEL))
            assert not host.hosted
        finally:
            server.close()
            for n in (coord, worker, owner, other):
                await n.ep.close()

    asyncio.run(main())


def test_a_warm_range_is_kept_on_disk_and_a_rebuild_then_fetches_nothing(tiny_model: Path, tmp_path: Path) -> None:
    """Warm: the range lands on disk unloaded (checked against the requester's manifest, at most
    MAX_STAGES_PER_MEMBER models per member), and a later Host of a range inside it (the rebuilt
    chain) loads it without a transfer."""
    async def main() -> None:
        coord, worker, other = [await node(tmp_path, n) for n in ("coord", "worker", "other")]
        entry = coord.library.add(tiny_model, source="file", owned=False)
        signed = sign_manifest(coord.key, build_manifest(tiny_model))
        server = StageServer(worker.ep)
        host = StageHost(server, worker.store, budget=1 << 30)
        warm = Warm(model=MODEL, model_id=entry.id, manifest=signed, layer_start=2, layer_end=6, addr=addr(coord.ep))
        try:
            with pytest.raises(HostRefused, match="past the model"):
                await ask(coord.ep, worker.id, addr(worker.ep), msgspec.structs.replace(warm, layer_end=60))
            with pytest.raises(HostRefused, match="not a host:port address"):
                await ask(coord.ep, worker.id, addr(worker.ep), msgspec.structs.replace(warm, addr="nowhere"))
            with pytest.raises(HostRefused, match="signed by another key"):  # another member, coord's manifest
                await ask(other.ep, worker.id, addr(worker.ep), warm)
            warmed = await ask(coord.ep, worker.id, addr(worker.ep), warm)
            assert isinstance(warmed, Warmed) and warmed.fetched_bytes > 0
            assert worker.library.stage(entry.id, 2, 6) is not None and not host.hosted  # on disk, not loaded
            rebuilt = await ask(coord.ep, worker.id, addr(worker.ep),
                                host_request(coord, worker, coord.key, entry.id, signed, bounds=(3, 6)))
            assert isinstance(rebuilt, Hosted) and rebuilt.fetched_bytes == 0 and rebuilt.layer_start == 3
            for i in range(1, MAX_STAGES_PER_MEMBER):
                await ask(coord.ep, worker.id, addr(worker.ep), msgspec.structs.replace(warm, model=f"m{i}"))
            with pytest.raises(HostRefused, match="warm ranges"):
                await ask(coord.ep, worker.id, addr(worker.ep), msgspec.structs.replace(warm, model="one-more"))
        finally:
            server.close()
            for n in (coord, worker, other):
                await n.ep.close()

    asyncio.run(main())
