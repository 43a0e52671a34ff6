"""Model transfers over real QUIC endpoints on 127.0.0.1: stage files, whole files, bad holders, resume."""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nacl.signing import SigningKey
from net.net_helpers import endpoint
from tinymodels import write_tiny_llama

from meshllm.engine.ggml import StageModel
from meshllm.models.gguf_file import GGUFFile
from meshllm.models.library import Library
from meshllm.models.manifest import build_manifest, sign_manifest
from meshllm.models.store import ModelStore, Offer
from meshllm.models.transfer import DATA_FRAME, WINDOW, TransferFailed, TransferState
from meshllm.net import Endpoint

PIECE = 1 << 16


def addr(ep: Endpoint) -> str:
    host, port = ep.local_addr
    return f"{host}:{port}"


def holder(tmp: Path, name: str, model: Path, corrupt_at: int | None = None) -> tuple[Library, Path]:
    """A holder's library with a copy of ``model``; ``corrupt_at`` flips that byte (the copy still claims the id)."""
    lib = Library(tmp / name / "models")
    copy = tmp / name / "tiny.gguf"
    copy.parent.mkdir(parents=True, exist_ok=True)
    data = bytearray(model.read_bytes())
    if corrupt_at is not None:
        data[corrupt_at] ^= 0xFF
    copy.write_bytes(bytes(data))
    entry = lib.add(copy, source="file", owned=False, model_id=hashlib.sha256(model.read_bytes()).hexdigest())
    assert entry.file == copy.resolve()
    return lib, copy


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tx") / "tiny.gguf", n_layers=6, seed=5)


def test_stage_file_from_two_holders_drops_the_corrupt_one(model: Path, tmp_path: Path) -> None:
    manifest = build_manifest(model, piece_size=PIECE)

    async def main() -> None:
        keys = [SigningKey.generate() for _ in range(3)]
        eps = [await endpoint(k) for k in keys]
        good_lib, _ = holder(tmp_path, "good", model)
        bad_lib, _ = holder(tmp_path, "bad", model, corrupt_at=manifest.spans[4].offset + 100)
        stores = [ModelStore(lib, ep, key, list, lambda *a, **k: None)
                  for lib, ep, key in ((good_lib, eps[0], keys[0]), (bad_lib, eps[1], keys[1]))]
        events: list[tuple[str, dict]] = []
        worker_lib = Library(tmp_path / "worker" / "models")
        good = Offer(eps[0].node_id, addr(eps[0]), manifest.model, "tiny", 1)
        worker = ModelStore(worker_lib, eps[2], keys[2], lambda: [good], lambda t, **f: events.append((t, f)))
        try:
            # the corrupt holder is asked first: it gets the piece with the flipped byte
            entry = await worker.stage_file(manifest, "tiny", 2, 4, [(eps[1].node_id, addr(eps[1]))])
            assert entry.kind == "stage" and entry.layers == (2, 4)
            reader = GGUFFile(entry.file)
            names = {t.name for t in reader.tensors}
            assert names and all(n.startswith(("blk.2.", "blk.3.")) or n == "token_embd.weight" for n in names)
            (dropped,) = [f for t, f in events if t == "transfer_holder_dropped"]
            assert dropped["holder"] == eps[1].node_id and dropped["bad_bytes"] and "sha256" in dropped["reason"]
            done = next(f for t, f in events if t == "transfer_done")
            # the corrupt holder is credited only pieces that verified (one may land before its bad one)
            total = sum(manifest.spans[i].length for i in (4, 5))
            assert done["holders"][eps[1].node_id] < PIECE * WINDOW
            assert done["holders"][eps[0].node_id] + done["holders"][eps[1].node_id] == total
            # the stage file computes exactly what the whole model's layers compute
            x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
            mine, full = StageModel.load(entry.file, 2, 4, max_context=64), StageModel.load(model, 2, 4,
                                                                                              max_context=64)
            assert np.array_equal(mine.forward("s", x, 0), full.forward("s", x, 0))
            mine.close()
            full.close()
            assert worker.status()[0]["state"] == "done"
        finally:
            for ep in eps:
                await ep.close()
        del stores

    asyncio.run(main())


class LyingStore(ModelStore):
    """A holder whose file is damaged and whose manifest describes that damaged file under the real id."""

    def signed_manifest(self, model_id: str) -> bytes:
        entry = self.library.whole(model_id)
        assert entry is not None
        return sign_manifest(self.key, msgspec.structs.replace(build_manifest(entry.file), model=model_id))


def test_whole_file_skips_a_lying_holder_and_resumes(model: Path, tmp_path: Path) -> None:
    model_id = hashlib.sha256(model.read_bytes()).hexdigest()

    async def main() -> None:
        keys = [SigningKey.generate() for _ in range(3)]
        eps = [await endpoint(k) for k in keys]
        bad_lib, _ = holder(tmp_path, "bad", model, corrupt_at=model.stat().st_size * 3 // 4)
        good_lib, _ = holder(tmp_path, "good", model)
        LyingStore(bad_lib, eps[0], keys[0], list, lambda *a, **k: None)
        ModelStore(good_lib, eps[1], keys[1], list, lambda *a, **k: None)
        worker_lib = Library(tmp_path / "w" / "models")
        # a previous, interrupted transfer left half of the file behind
        part = worker_lib.incoming(f"{model_id}.part")
        half = model.read_bytes()[: model.stat().st_size // 2]
        part.write_bytes(half + bytes(model.stat().st_size - len(half)))
        events: list[tuple[str, dict]] = []
        holders = [(eps[0].node_id, addr(eps[0])), (eps[1].node_id, addr(eps[1]))]
        worker = ModelStore(worker_lib, eps[2], keys[2], lambda: [Offer(n, a, model_id, 'tiny', 1) for n, a in holders],
                            lambda t, **f: events.append((t, f)))
        try:
            entry = await worker.whole_file(model_id, "tiny")
            assert entry.id == model_id and hashlib.sha256(entry.file.read_bytes()).hexdigest() == model_id
            assert worker_lib.whole(model_id) is not None
            done = next(f for t, f in events if t == "transfer_done")
            assert sum(done["holders"].values()) < model.stat().st_size  # the first half was kept
            lies = [f for t, f in events if t == "transfer_holder_dropped" and f["holder"] == eps[0].node_id]
            assert lies and "model id" in lies[0]["reason"]
        finally:
            for ep in eps:
                await ep.close()

    asyncio.run(main())


def test_no_holder_left_is_a_clear_error(model: Path, tmp_path: Path) -> None:
    manifest = build_manifest(model, piece_size=PIECE)

    async def main() -> None:
        keys = [SigningKey.generate() for _ in range(2)]
        eps = [await endpoint(k) for k in keys]
        ModelStore(Library(tmp_path / "empty" / "models"), eps[0], keys[0], list, lambda *a, **k: None)
        worker = ModelStore(Library(tmp_path / "w" / "models"), eps[1], keys[1], list,
                            lambda *a, **k: None)
        try:
            with pytest.raises(TransferFailed, match="does not offer"):
                await worker.stage_file(manifest, "tiny", 0, 2, [(eps[0].node_id, addr(eps[0]))])
            assert worker.status()[0]["state"] == "failed"
        finally:
            for ep in eps:
                await ep.close()

    asyncio.run(main())


def test_a_holder_found_mid_transfer_joins_it(model: Path, tmp_path: Path) -> None:
    """A node that just joined learns of more holders while its first transfer runs: they take part."""
    manifest = build_manifest(model, piece_size=PIECE)

    async def main() -> None:
        keys = [SigningKey.generate() for _ in range(3)]
        eps = [await endpoint(k) for k in keys]
        slow_lib, _ = holder(tmp_path, "slow", model)
        late_lib, _ = holder(tmp_path, "late", model)
        ModelStore(slow_lib, eps[0], keys[0], list, lambda *a, **k: None, upload_bytes_s=1e6)  # the lowest cap
        ModelStore(late_lib, eps[1], keys[1], list, lambda *a, **k: None)
        offers: list[Offer] = []  # what gossip has told the worker so far: nothing yet
        events: list[tuple[str, dict]] = []
        worker = ModelStore(Library(tmp_path / "w" / "models"), eps[2], keys[2], lambda: offers,
                            lambda t, **f: events.append((t, f)))
        try:
            fetching = asyncio.create_task(worker.stage_file(manifest, "tiny", 0, 6, [(eps[0].node_id, addr(eps[0]))]))
            deadline = time.monotonic() + 10.0
            while not (worker.status() and worker.status()[0]["bytes_done"]):  # the first piece is in
                assert time.monotonic() < deadline and not fetching.done()
                await asyncio.sleep(0.01)
            offers.append(Offer(eps[1].node_id, addr(eps[1]), manifest.model, "tiny", 1))
            entry = await asyncio.wait_for(fetching, 30.0)
            assert entry.layers == (0, 6)
            done = next(f for t, f in events if t == "transfer_done")
            assert done["holders"][eps[0].node_id] > 0 and done["holders"][eps[1].node_id] > 0
            assert sum(done["holders"].values()) == done["bytes"]
        finally:
            for ep in eps:
                await ep.close()

    asyncio.run(main())


def test_an_upload_cap_paces_every_stream_of_a_holder(model: Path, tmp_path: Path) -> None:
    """``model_upload_limit_mb_s``: a capped holder sends no faster than its cap, whatever asks."""
    model_id = hashlib.sha256(model.read_bytes()).hexdigest()

    async def main() -> None:
        keys = [SigningKey.generate() for _ in range(2)]
        eps = [await endpoint(k) for k in keys]
        lib, _ = holder(tmp_path, "capped", model)
        ModelStore(lib, eps[0], keys[0], list, lambda *a, **k: None, upload_bytes_s=1e6)
        offer = Offer(eps[0].node_id, addr(eps[0]), model_id, "tiny", 1)
        worker = ModelStore(Library(tmp_path / "w" / "models"), eps[1], keys[1], lambda: [offer],
                            lambda *a, **k: None)
        try:
            started = time.monotonic()
            await worker.whole_file(model_id, "tiny")
            took = time.monotonic() - started
            # a lower bound only: a loaded host makes it slower, never faster
            assert took >= (model.stat().st_size - DATA_FRAME) / 1e6 * 0.95, took
        finally:
            for ep in eps:
                await ep.close()

    asyncio.run(main())


def test_state_requeues_the_pieces_of_a_dropped_holder() -> None:
    from meshllm.models.manifest import Piece

    pieces = [Piece(1, i * 10, 10, b"x" * 32) for i in range(5)]
    state = TransferState(pieces, [("a", "1"), ("b", "2")], window=2)
    assert [state.take("a"), state.take("a"), state.take("a")] == [0, 1, None]
    assert [state.take("b"), state.take("b")] == [2, 3]
    state.arrived("a", 0, ok=True)
    state.failed("a", 1, "reset")
    assert state.take("a") is None and state.live == ["b"] and list(state.pending)[:1] == [1]
    state.arrived("b", 2, ok=False)
    assert state.live == [] and state.holders["b"].bad and sorted(state.pending) == [1, 2, 3, 4]
    assert state.done_bytes == 10 and not state.finished
    assert state.join("c", "3") and not state.join("b", "2")  # a new holder joins; a dropped one stays dropped
    assert state.live == ["c"] and state.take("c") in (1, 2, 3, 4)
