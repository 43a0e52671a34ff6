"""The stage-control protocol over real QUIC endpoints: hosting by model id with a signed manifest (the worker
fetches its range), and who may host, re-place and release a stage."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest
from nacl.signing import SigningKey
from split_helpers import MODEL, addr, endpoint
from tinymodels import write_tiny_llama

from meshllm.mesh.records import Addresses, Capacity, PeerRecord
from meshllm.models.gguf_file import GGUFFile
from meshllm.models.library import Library, LibraryEntry
from meshllm.models.manifest import build_manifest, sign_manifest
from meshllm.models.refs import ModelRef
from meshllm.models.store import ModelStore
from meshllm.net import Endpoint
from meshllm.split import placement as placement_module
from meshllm.split.control import (
    MAX_STAGES_PER_MEMBER,
    Host,
    Hosted,
    HostRefused,
    Release,
    Released,
    StageHost,
    Unwarm,
    Warm,
    Warmed,
    ask,
)
from meshllm.split.engine import SplitEngine
from meshllm.split.errors import NoChainFits, StageFailed
from meshllm.split.frames import Hop
from meshllm.split.placement import RAM_SHARE, SplitOptions, SplitPlacement, candidates, model_profile, node_budget
from meshllm.split.planner import PlanOptions, plan
from meshllm.split.service import offered_capacity
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


def record(n: Node, role: str, ram: int = 1 << 33) -> PeerRecord:
    """``n``'s peer record as the placement reads it from gossip (``ram``: the memory it offers)."""
    return PeerRecord(node_id=n.id, mesh_id="m", seq=1, membership_proof=b"p", role=role,  # type: ignore[arg-type]
                      capacity=Capacity(ram_bytes=ram, gflops=10.0), addresses=Addresses(listen=[addr(n.ep)]))


async def coordinator_and_workers(
        tmp: Path, model: Path) -> tuple[tuple[Node, Node, Node], LibraryEntry, bytes, list[StageServer],
                                         dict[str, StageHost]]:
    """A coordinator holding ``model`` and two workers with stage hosts: the nodes, the coordinator's library
    entry and signed manifest, the stage servers (the coordinator's first), the hosts by worker id."""
    coord, w1, w2 = [await node(tmp, n) for n in ("coord", "w1", "w2")]
    entry = coord.library.add(model, source="file", owned=False)
    servers = [StageServer(n.ep) for n in (coord, w1, w2)]
    hosts = {w.id: StageHost(server, w.store, budget=1 << 30) for server, w in zip(servers[1:], (w1, w2), strict=True)}
    return (coord, w1, w2), entry, sign_manifest(coord.key, build_manifest(model)), servers, hosts


async def shut(placement: SplitPlacement, servers: list[StageServer], nodes: tuple[Node, ...]) -> None:
    await placement.stop()
    for server in servers:
        server.close()
    for n in nodes:
        await n.ep.close()


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


@pytest.mark.parametrize("cap", [None, "cap"])
def test_a_plan_from_a_workers_record_is_never_refused_for_memory(
        cap: str | None, tiny_model: Path, tmp_path: Path) -> None:
    """The planner's memory for a worker comes from its record; its StageHost's budget from the same record
    (``node_budget``). Around the point where the worker's range just fits, each plan the planner makes from
    the record is hosted by the worker; where the record's memory is too small, no plan is made. (Before,
    a worker without ``--max-memory`` offered all its RAM but accepted 75 % of it: the cases whose need lies
    between the two were planned, then refused.)"""
    profile = model_profile(tiny_model, 64)
    first = profile.first_bytes + profile.layer_bytes + profile.stage_bytes  # the coordinator: layer 0 only
    need = 5 * profile.layer_bytes + profile.last_bytes + profile.stage_bytes  # the worker: layers 1..6

    async def main() -> None:
        coord, worker = [await node(tmp_path, n) for n in ("coord", "worker")]
        entry = coord.library.add(tiny_model, source="file", owned=False)
        signed = sign_manifest(coord.key, build_manifest(tiny_model))
        server = StageServer(worker.ep)
        host = StageHost(server, worker.store, budget=0)
        own = PeerRecord(node_id=coord.id, mesh_id="m", seq=1, membership_proof=b"p", role="host",
                         capacity=Capacity(ram_bytes=1 << 33, gflops=10.0),
                         addresses=Addresses(listen=[addr(coord.ep)]))
        hosted = planned_only = 0
        try:
            for share in (0.9, 0.99, 1.0, 1.01, 1.2):
                offer = int(need * share)  # what the worker should offer: its --max-memory, else 75 % of its RAM
                max_memory = offer if cap else None
                ram = 2 * offer if cap else -(-offer * 4 // 3)
                capacity = offered_capacity(Capacity(ram_bytes=ram, gflops=10.0), "worker", max_memory)
                record = PeerRecord(node_id=worker.id, mesh_id="m", seq=1, membership_proof=b"p", role="worker",
                                    capacity=capacity, addresses=Addresses(listen=[addr(worker.ep)]))
                host.budget = node_budget(record, max_memory)  # what SplitService gives the worker's StageHost
                nodes = candidates(own, first, {worker.id: record})
                planned_only += int(need <= ram < need / RAM_SHARE)  # the old record's offer, the old host's refusal
                try:
                    chosen = plan(profile, nodes, {}, coord.id, PlanOptions(stages=2))
                except NoChainFits:
                    assert offer < need
                    continue
                assert chosen.chain == [(coord.id, 0, 1), (worker.id, 1, 6)]
                request = host_request(coord, worker, coord.key, entry.id, signed, bounds=(1, 6))
                assert isinstance(await ask(coord.ep, worker.id, addr(worker.ep), request), Hosted)
                await ask(coord.ep, worker.id, addr(worker.ep), Release(model=MODEL))
                hosted += 1
            assert hosted == 3
            assert planned_only >= (0 if cap else 2)  # the cases the old mismatch planned and then refused
        finally:
            server.close()
            for n in (coord, worker):
                await n.ep.close()

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
            with pytest.raises(HostRefused, match="no warm range"):  # only its requester may drop a warm range
                await ask(other.ep, worker.id, addr(worker.ep), Unwarm(model=MODEL))
            assert (coord.id, MODEL) in host.warm
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


def test_a_warm_range_outlives_a_transfer_that_would_evict_it(tiny_model: Path, tmp_path: Path) -> None:
    """A worker pins its warm ranges (weakly) in its library: under a small disk budget a transfer makes
    room by evicting an unpinned stage file, though the warm one is older. Only when nothing else makes
    room is a warm file evicted; the coordinator's refresh (the same Warm, no manifest) is then refused,
    so it stops counting on those layers. Unwarm, or a new range, releases the pin."""
    async def main() -> None:
        coord, worker = [await node(tmp_path, n) for n in ("coord", "worker")]
        lib = worker.library
        other_file = write_tiny_llama(tmp_path / "other.gguf", n_layers=6, seed=9)
        entry = coord.library.add(tiny_model, source="file", owned=False)
        other = coord.library.add(other_file, source="file", owned=False)
        signed = sign_manifest(coord.key, build_manifest(tiny_model))
        other_signed = sign_manifest(coord.key, build_manifest(other_file))
        server = StageServer(worker.ep)
        host = StageHost(server, worker.store, budget=1 << 30)
        warm = Warm(model=MODEL, model_id=entry.id, manifest=signed, layer_start=2, layer_end=6, addr=addr(coord.ep))
        refresh = msgspec.structs.replace(warm, manifest=b"")

        def other_warm(start: int, end: int) -> Warm:
            return Warm(model="other", model_id=other.id, manifest=other_signed, layer_start=start, layer_end=end,
                        addr=addr(coord.ep))

        async def to_worker(request: Host | Warm | Unwarm) -> object:
            return await ask(coord.ep, worker.id, addr(worker.ep), request)

        try:
            with pytest.raises(HostRefused, match="not kept warm here"):  # a refresh of nothing fetches nothing
                await to_worker(refresh)
            assert isinstance(await to_worker(warm), Warmed)  # the warm range: the oldest file
            kept = lib.stage(entry.id, 2, 6)
            assert kept is not None and kept.key in lib.kept
            assert isinstance(await to_worker(other_warm(1, 4)), Warmed)
            dropped = lib.stage(other.id, 1, 4)
            assert dropped is not None
            assert isinstance(await to_worker(Unwarm(model="other")), Released)
            assert dropped.key not in lib.kept and ("other" not in {m for _, m in host.warm})
            # room for one more 3-layer stage file only if one file goes: least recently used is the warm one
            lib.budget_bytes = kept.disk_bytes() + dropped.disk_bytes() + dropped.disk_bytes() // 2
            assert isinstance(await to_worker(other_warm(2, 5)), Warmed)
            assert lib.stage(other.id, 1, 4) is None  # the unpinned file went, though used later
            assert lib.stage(entry.id, 2, 6) is not None
            again = await to_worker(refresh)
            assert isinstance(again, Warmed) and again.fetched_bytes == 0
            # a full disk: both warm files pinned weakly, a stage to host needs room: the older warm file goes
            newer = lib.stage(other.id, 2, 5)
            assert newer is not None
            lib.budget_bytes = kept.disk_bytes() + newer.disk_bytes() + 1
            hosted = await to_worker(host_request(coord, worker, coord.key, other.id, other_signed, bounds=(1, 2),
                                                  model="other-stage"))
            assert isinstance(hosted, Hosted) and hosted.fetched_bytes > 0
            assert lib.stage(entry.id, 2, 6) is None and kept.key not in lib.kept
            with pytest.raises(HostRefused, match="evicted"):  # the coordinator learns it is gone
                await to_worker(refresh)
            assert (coord.id, MODEL) not in host.warm
            with pytest.raises(HostRefused, match="no warm range"):
                await to_worker(Unwarm(model=MODEL))
            assert lib.stage(other.id, 2, 5) is not None  # the newer warm file stayed
            lib.budget_bytes = None
            assert isinstance(await to_worker(other_warm(3, 6)), Warmed)  # a new range releases the old one
            moved = lib.stage(other.id, 3, 6)
            assert moved is not None and moved.key in lib.kept
            assert lib.stage(other.id, 2, 5) is not None and newer.key not in lib.kept
        finally:
            server.close()
            for n in (coord, worker):
                await n.ep.close()

    asyncio.run(main())


def test_the_coordinator_stops_counting_on_a_warm_range_its_worker_lost(
        tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Placement's spare keeping over real workers: the spare's range counts as held (a rebuild would
    plan inside it) while the worker keeps it; once its library had to evict the file (a full disk),
    the next check's refresh is refused, the range leaves ``held`` and ``split_spares_ready`` names why."""
    monkeypatch.setattr(placement_module, "SPARE_CHECK_S", 0.05)

    async def main() -> None:
        (coord, w1, w2), entry, signed, servers, _hosts = await coordinator_and_workers(tmp_path, tiny_model)

        members = {w.id: record(w, "worker") for w in (w1, w2)}
        events: list[tuple[str, dict[str, object]]] = []
        placement = SplitPlacement(
            own=lambda: record(coord, "host"), members=lambda: members, rtt=dict, server=servers[0],
            engine=SplitEngine(tiny_model, MODEL, 64), ref=ModelRef(tiny_model, MODEL, entry.id), manifest=signed,
            options=SplitOptions(mode="force", context=64), budget=1 << 33,
            publish=lambda kind, **fields: events.append((kind, fields)), on_chain=lambda _chain: None,
            profile=model_profile(tiny_model, 64))
        chain = [Hop(coord.id, addr(coord.ep), 0, 3), Hop(w1.id, addr(w1.ep), 3, 6)]

        async def until(done: Callable[[], bool]) -> None:
            async with asyncio.timeout(20.0):
                while not done():
                    await asyncio.sleep(0.02)

        keeping = asyncio.ensure_future(placement._keep_spares(chain))
        try:
            await until(lambda: w2.id in placement.held)  # the spare for w1's death: w2 keeps the rebuilt range
            (start, end), = placement.held[w2.id]
            assert w2.library.stage(entry.id, start, end) is not None and w1.id in placement.covered
            w2.library.budget_bytes = 1  # a full disk: only the warm file is left to evict
            assert [e.layers for e in w2.library.reserve(0)] == [(start, end)]
            await until(lambda: w2.id not in placement.held)
            assert w1.id not in placement.covered and not placement.spares
            kind, last = events[-1]
            assert kind == "split_spares_ready" and "evicted" in str(last["failed"])
        finally:
            keeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeping
            for server in servers:
                server.close()
            for n in (coord, w1, w2):
                await n.ep.close()

    asyncio.run(main())


def test_a_released_stage_leaves_what_the_coordinator_counts_on(
        tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real placement loop over real workers: a chain on one worker while the other keeps a warm spare.
    An audit evicts the chain's worker; its stage is released, the worker unpins the file (its library may
    evict it), and its range leaves ``held`` at once: a rebuild never counts on it. The spare's warm range
    stays held, and the rebuilt chain hosts inside it without a transfer; the range it hosts is then held."""
    monkeypatch.setattr(placement_module, "SPARE_CHECK_S", 0.05)

    async def main() -> None:
        (coord, w1, w2), entry, signed, servers, hosts = await coordinator_and_workers(tmp_path, tiny_model)
        workers = {w.id: w for w in (w1, w2)}

        members = {w.id: record(w, "worker") for w in (w1, w2)}
        engine = SplitEngine(tiny_model, MODEL, 64)
        placement = SplitPlacement(
            own=lambda: record(coord, "host"), members=lambda: members, rtt=dict, server=servers[0],
            engine=engine, ref=ModelRef(tiny_model, MODEL, entry.id), manifest=signed,
            options=SplitOptions(mode="force", stages=2, context=64), budget=1 << 33,
            publish=lambda *_a, **_k: None, on_chain=lambda _chain: None, profile=model_profile(tiny_model, 64))

        async def until(done: Callable[[], bool]) -> None:
            async with asyncio.timeout(20.0):
                while not done():
                    await asyncio.sleep(0.02)

        placement.start()
        try:
            await until(lambda: engine.coordinator is not None)
            old = engine.coordinator
            assert old is not None
            hop = placement.chain[1]
            (spare,) = set(workers) - {hop.node_id}
            await until(lambda: spare in placement.held)  # the spare for hop's death keeps its range warm
            warm = placement.held[spare]
            assert placement.held[hop.node_id] == {(hop.layer_start, hop.layer_end)}
            released = workers[hop.node_id].library
            pinned = hosts[hop.node_id].hosted[(coord.id, MODEL)].entry.key
            assert pinned in released.pinned
            placement.evict(old, {hop.node_id}, "a test")
            assert hop.node_id not in placement.held and placement.held[spare] == warm
            await until(lambda: not hosts[hop.node_id].hosted)  # the worker released it: the file unpinned
            assert pinned not in released.pinned
            await until(lambda: engine.coordinator not in (None, old))
            rebuilt = placement.chain[1]
            assert rebuilt.node_id == spare and hop.node_id not in placement.held
            assert any(a <= rebuilt.layer_start and rebuilt.layer_end <= b for a, b in warm)
            assert spare not in placement.fetching  # built inside the warm range: nothing fetched
            assert (rebuilt.layer_start, rebuilt.layer_end) in placement.held[spare]
        finally:
            await shut(placement, servers, (coord, w1, w2))

    asyncio.run(main())


def test_a_replaced_stage_leaves_what_the_coordinator_counts_on(tiny_model: Path, tmp_path: Path) -> None:
    """The real placement loop: a replan that gives a worker another range replaces its stage, and the
    worker unpins the old range's file; ``held`` then names only the new range (no warm spares here)."""
    profile = model_profile(tiny_model, 64)

    def room(first: bool, layers: int) -> int:
        return (profile.first_bytes if first else profile.last_bytes) + layers * profile.layer_bytes \
            + profile.stage_bytes

    async def main() -> None:
        coord, worker = [await node(tmp_path, n) for n in ("coord", "worker")]
        entry = coord.library.add(tiny_model, source="file", owned=False)
        signed = sign_manifest(coord.key, build_manifest(tiny_model))
        servers = [StageServer(n.ep) for n in (coord, worker)]
        host = StageHost(servers[1], worker.store, budget=1 << 30)

        members = {worker.id: record(worker, "worker", room(False, 3))}  # the worker fits 3 layers at most
        engine = SplitEngine(tiny_model, MODEL, 64)
        placement = SplitPlacement(
            own=lambda: record(coord, "host", 1 << 33), members=lambda: members, rtt=dict, server=servers[0],
            engine=engine, ref=ModelRef(tiny_model, MODEL, entry.id), manifest=signed,
            options=SplitOptions(mode="force", stages=2, context=64, spares=False), budget=1 << 33,
            publish=lambda *_a, **_k: None, on_chain=lambda _chain: None, profile=profile)

        async def until(done: Callable[[], bool]) -> None:
            async with asyncio.timeout(20.0):
                while not done():
                    await asyncio.sleep(0.02)

        placement.start()
        try:
            await until(lambda: engine.coordinator is not None)
            old = engine.coordinator
            hop = placement.chain[1]
            assert hop.layer_start >= 3 and placement.held == {worker.id: {(hop.layer_start, 6)}}
            first = host.hosted[(coord.id, MODEL)].entry.key
            # the worker offers more, the coordinator less: the replan moves the boundary to layer 1
            members[worker.id] = record(worker, "worker", room(False, 5))
            placement.budget = room(True, 1)
            placement.stage_failed(StageFailed(0, coord.id, "a test"))
            await until(lambda: engine.coordinator not in (None, old))
            assert [(h.layer_start, h.layer_end) for h in placement.chain] == [(0, 1), (1, 6)]
            assert placement.held == {worker.id: {(1, 6)}}
            now = host.hosted[(coord.id, MODEL)].entry.key
            assert now != first and now in worker.library.pinned and first not in worker.library.pinned
        finally:
            await shut(placement, servers, (coord, worker))

    asyncio.run(main())


def test_a_failed_placement_first_hears_every_other_hop(tiny_model: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A placement fails when one hop fails, but only once every other hop has answered: a hop still fetching
    would otherwise run on beside the next placement, which asks its worker for the same range again (and
    the one transfer was reported as two fetches). Real workers; the first hop is refused at once."""
    async def main() -> None:
        (coord, w1, w2), entry, signed, servers, hosts = await coordinator_and_workers(tmp_path, tiny_model)

        members = {w.id: record(w, "worker") for w in (w1, w2)}
        events: list[str] = []
        placement = SplitPlacement(
            own=lambda: record(coord, "host"), members=lambda: members, rtt=dict, server=servers[0],
            engine=SplitEngine(tiny_model, MODEL, 64), ref=ModelRef(tiny_model, MODEL, entry.id), manifest=signed,
            options=SplitOptions(mode="force", stages=3, context=64, spares=False), budget=1 << 33,
            publish=lambda kind, **_fields: events.append(kind), on_chain=lambda _chain: None,
            profile=model_profile(tiny_model, 64))
        real = placement._host

        async def refuse_the_first(chain: list[Hop], index: int, hub: bytes = b"") -> None:
            if index == 1:
                raise StageFailed(1, chain[1].node_id, "refused (a test)")
            await asyncio.sleep(0.3)  # still fetching when the other hop failed
            await real(chain, index, hub)

        try:
            monkeypatch.setattr(placement, "_host", refuse_the_first)
            with pytest.raises(StageFailed, match="a test"):
                await placement._place()
            last = placement.placing[2]
            assert (coord.id, MODEL) in hosts[last.node_id].hosted  # its answer was in
            assert events.count("split_stage_fetched") == 1
            monkeypatch.setattr(placement, "_host", real)
            await placement._place()
            assert placement.chain[2] == last and events.count("split_stage_fetched") == 2  # the first hop's only
        finally:
            await shut(placement, servers, (coord, w1, w2))

    asyncio.run(main())
