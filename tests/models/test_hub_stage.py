"""Stages straight from the hub, in-process against the local hub server (``tests/hub_server.py``).

A coordinator's :class:`HubModel` fetches the header and its own layers only; a worker fetches the
header and its own layers into a stage file whose bytes are the original's; every piece the two
share is cross-checked, and a disagreement is refetched with the bad source named (the hub's
answer, or the coordinator); a file that changes on the hub mid-fetch or since the plan is caught;
an interrupted stage fetch resumes with the pieces still missing; a pull whose file changes mid-way
starts over and ends with the new version only.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from hub_server import Hub, hub_server
from nacl.signing import SigningKey
from tinymodels import write_tiny_llama

from meshllm.engine.ggml import StageModel
from meshllm.errors import DecodeError, VerificationError
from meshllm.identity.ids import node_id
from meshllm.models.gguf_file import GGUFFile
from meshllm.models.hub_fetch import HubError, HubFileChanged
from meshllm.models.hub_stage import HubModel, HubSource, fetch_stage_blocking, open_source, sign_source
from meshllm.models.library import Library
from meshllm.models.manifest import BadManifest, build_manifest
from meshllm.models.stage_file import stage_range

pytestmark = pytest.mark.timeout(120)
REPO = "tiny-org/tiny-GGUF"
SPEC = f"hf:{REPO}/tiny.gguf"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("hubstage") / "tiny.gguf", n_layers=6, seed=3)


@pytest.fixture
def hub(model: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Hub]:
    with hub_server() as hub:
        hub.add(REPO, "tiny.gguf", model.read_bytes())
        # huggingface_hub reads HF_ENDPOINT once, at import: point its constants at this server too
        from huggingface_hub import constants

        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            hub.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        yield hub


def tensor_bytes(path: Path, names: set[str]) -> dict[str, bytes]:
    reader = GGUFFile(path)
    data = path.read_bytes()
    return {t.name: data[t.offset:t.offset + t.nbytes] for t in reader.tensors if t.name in names}


def test_each_node_fetches_only_its_own_ranges(model: Path, hub: Hub, tmp_path: Path) -> None:
    hub.redirect = True  # ranges come from the CDN location, as on the real hub
    hub.fail_gets = {3}  # a 500 midway: retried
    size = model.stat().st_size
    coordinator = HubModel.open(SPEC, Library(tmp_path / "c"))
    assert coordinator.model_id == hashlib.sha256(model.read_bytes()).hexdigest()
    coordinator.ensure(0, 2)
    assert coordinator.fetched == hub.bytes_sent < size / 2, (coordinator.fetched, size)
    assert coordinator.path.stat().st_blocks * 512 < size  # sparse: only the header and its layers are there
    first = StageModel.load(coordinator.path, 0, 2, max_context=64)
    first.close()
    # a restarted coordinator keeps its copy: no byte is asked again for the header or its layers
    asked = len(hub.ranges)
    again = HubModel.open(SPEC, Library(tmp_path / "c"))
    assert again.ensure(0, 2).fetched == 0 and again.fetched == 0 and len(hub.ranges) == asked

    sent = hub.bytes_sent
    done = fetch_stage_blocking(Library(tmp_path / "w"), coordinator.source(), "tiny", 4, 6)
    assert done.fetched == hub.bytes_sent - sent and not done.disagreements
    reader = GGUFFile(done.entry.file)
    assert stage_range(reader) == (coordinator.model_id, "tiny", 4, 6)
    held = {t.name for t in reader.tensors} - {"token_embd.weight"}
    assert "output.weight" in held and not any(n.startswith("blk.0.") for n in held)
    assert tensor_bytes(done.entry.file, held) == tensor_bytes(model, held)
    header = len(coordinator.header)
    share = sum(t.nbytes for t in reader.tensors if t.name in held)
    assert share <= done.fetched - header < share + 64 * len(held)  # its tensors (with alignment padding), no more
    print(f"file {size} B; coordinator fetched {coordinator.fetched} B; last stage {done.fetched} B")


def test_a_piece_that_disagrees_is_refetched_and_the_bad_source_named(model: Path, hub: Hub,
                                                                      tmp_path: Path) -> None:
    coordinator = HubModel.open(SPEC, Library(tmp_path / "c"))
    source = coordinator.source()
    # the hub's first answer to the worker is damaged (its second answer and the coordinator agree)
    hub.corrupt_nth(8, 1)
    done = fetch_stage_blocking(Library(tmp_path / "w1"), source, "tiny", 2, 4, reference_name="node c0ffee")
    ((bad),) = done.disagreements or []
    assert bad.offset == 0 and bad.bad.startswith("hub 127.0.0.1:")
    assert GGUFFile(done.entry.file).fields["general.name"] == "tiny-llama"
    # the coordinator's digest of the header is wrong (two hub answers agree): the coordinator is named
    forged = msgspec.structs.replace(source, digests={**source.digests, 0: hashlib.sha256(b"forged").digest()})
    key = SigningKey.generate()
    signer = node_id(bytes(key.verify_key))
    opened = open_source(sign_source(key, forged), signer, coordinator.model_id)
    done = fetch_stage_blocking(Library(tmp_path / "w2"), opened, "tiny", 2, 4, reference_name="node c0ffee")
    assert [d.bad for d in done.disagreements or []] == ["node c0ffee"]
    held = {t.name for t in GGUFFile(done.entry.file).tensors} - {"token_embd.weight"}
    assert tensor_bytes(done.entry.file, held) == tensor_bytes(model, held)
    # pieces the coordinator lacks are checked against a whole-file holder's manifest: a forged digest names it
    manifest = build_manifest(model)
    holders = {p.offset: (p.digest, "node h0ld3r") for i in range(len(manifest.spans)) for p in manifest.pieces(i)}
    layer = next(t.offset for t in GGUFFile(model).tensors if t.name == "blk.3.attn_q.weight")
    (piece,) = [o for o in holders if o <= layer < o + next(p.length for i in range(len(manifest.spans))
                                                               for p in manifest.pieces(i) if p.offset == o)]
    holders[piece] = (hashlib.sha256(b"forged").digest(), "node h0ld3r")
    hub.corrupt_nth(layer + 5, 1)  # and the hub's first answer of that piece is damaged too: still resolved
    done = fetch_stage_blocking(Library(tmp_path / "w3"), source, "tiny", 2, 4, holders=holders)
    named = sorted(d.bad for d in done.disagreements or [] if d.offset == piece)
    assert named == [f"hub {hub.url.removeprefix('http://')}", "node h0ld3r"]  # the hub's 2nd and 3rd answers agree
    assert tensor_bytes(done.entry.file, held) == tensor_bytes(model, held)


def test_an_interrupted_stage_fetch_resumes_with_the_missing_pieces(model: Path, hub: Hub, tmp_path: Path) -> None:
    coordinator = HubModel.open(SPEC, Library(tmp_path / "c"))
    library = Library(tmp_path / "w")
    stop = threading.Event()
    with pytest.raises(HubError, match="stopped"):  # stopped once the first piece is written
        fetch_stage_blocking(library, coordinator.source(), "tiny", 0, 6, stop=stop,
                             report=lambda done, _total: done and stop.set())
    (book,) = (tmp_path / "w" / "incoming").glob("*.pieces")
    kept = {int(k) for k in json.loads(book.read_text())["pieces"]}
    asked = len(hub.ranges)
    done = fetch_stage_blocking(library, coordinator.source(), "tiny", 0, 6)
    again = {int(r.split("=")[1].split("-")[0]) for r in hub.ranges[asked:] if r}
    assert kept and 0 in again and not (kept - {0}) & again  # the header is always read; kept layers are not
    held = {t.name for t in GGUFFile(done.entry.file).tensors}
    assert tensor_bytes(done.entry.file, held) == tensor_bytes(model, held)
    assert not book.exists()


def test_a_file_that_changes_on_the_hub_is_caught(model: Path, hub: Hub, tmp_path: Path) -> None:
    coordinator = HubModel.open(SPEC, Library(tmp_path / "c"))
    data = model.read_bytes()
    newer = data[:-16] + bytes(16)
    # changed while the coordinator reads the header: it opens the new version instead
    asked = len(hub.ranges)
    hub.swap_after = (asked, REPO, "tiny.gguf", newer)  # the next GET (its header probe) is of a new version
    reopened = HubModel.open(SPEC, Library(tmp_path / "c2"))
    assert reopened.model_id == hashlib.sha256(newer).hexdigest() != coordinator.model_id
    assert len(hub.ranges) - asked == 2  # the old version's probe was refused, the new one's kept
    hub.add(REPO, "tiny.gguf", data)
    # changed since the coordinator planned: the worker refuses before fetching a layer
    hub.add(REPO, "tiny.gguf", newer)
    with pytest.raises(HubFileChanged, match="changed on the hub since the coordinator planned"):
        fetch_stage_blocking(Library(tmp_path / "w"), coordinator.source(), "tiny", 4, 6)
    # changed mid-fetch: the next range answer carries the new ETag
    hub.add(REPO, "tiny.gguf", data)
    hub.swap_after = (len(hub.ranges) + 2, REPO, "tiny.gguf", newer)
    with pytest.raises(HubFileChanged, match="changed on the hub mid-fetch"):
        fetch_stage_blocking(Library(tmp_path / "w2"), coordinator.source(), "tiny", 0, 6)
    assert (tmp_path / "w2").is_dir() and not list((tmp_path / "w2").glob("stages/*.gguf"))


def test_a_pull_whose_file_changes_midway_starts_over(hub: Hub, tmp_path: Path) -> None:
    data = write_tiny_llama(tmp_path / "big.gguf", n_layers=3, width=384, ffn=1536, seed=4).read_bytes()
    newer = data[:-16] + bytes(16)
    hub.add(REPO, "big.gguf", data)
    hub.throttle = 8_000_000
    hub.swap_after = (2, REPO, "big.gguf", newer)  # two pieces of the old version arrive, then a new version
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1"}
    done = subprocess.run([sys.executable, "-m", "meshllm", "models", "pull", f"hf:{REPO}/big.gguf", "--home",
                           str(tmp_path / "home"), "--json"], capture_output=True, text=True, timeout=90, env=env)
    assert done.returncode == 0, done.stderr
    entry = json.loads(done.stdout)
    assert entry["id"] == hashlib.sha256(newer).hexdigest()
    assert Path(entry["path"]).read_bytes() == newer
    incoming = tmp_path / "home" / "models" / "incoming"
    assert not list(incoming.glob("*")), "nothing of the old version is left behind"
    assert len(Library.for_home(tmp_path / "home").entries()) == 1


def test_a_hub_source_opens_only_as_its_coordinator_signed_it() -> None:
    key, other = SigningKey.generate(), SigningKey.generate()
    signer = node_id(bytes(key.verify_key))
    source = HubSource(spec=SPEC, size=1000, etag="ab" * 32, header_length=100)
    assert open_source(sign_source(key, source), signer, "ab" * 32) == source
    with pytest.raises(VerificationError):
        open_source(sign_source(other, source), signer, "ab" * 32)  # not the coordinator's signature
    with pytest.raises(BadManifest, match="not cd"):
        open_source(sign_source(key, source), signer, "cd" * 32)  # another model
    with pytest.raises(BadManifest, match="names no file"):
        open_source(sign_source(key, msgspec.structs.replace(source, spec=f"hf:{REPO}:Q4_K_M")), signer, "ab" * 32)
    with pytest.raises(BadManifest, match="header is longer"):
        open_source(sign_source(key, msgspec.structs.replace(source, header_length=2000)), signer, "ab" * 32)
    with pytest.raises(DecodeError):
        open_source(b"\x93garbage", signer, "ab" * 32)
