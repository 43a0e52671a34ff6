"""A node's models on disk: its library, the ``model-fetch`` server, and transfers from peers.

What the node offers the mesh is its library's whole models (peer records list their ids). What it
fetches is either a **stage file** (a worker asked to host layers of a model it lacks: only the
header and that range's spans, checked against the coordinator's signed manifest) or a **whole
model** (``serve --model ID`` on a node without the file: every span, checked against a holder's
manifest, and then the whole file against the model id — a holder whose manifest does not add up
to the id is dropped and the next holder's manifest is tried, keeping every piece that still
verifies). Each transfer shows in :meth:`ModelStore.status` (``/api/status`` ``transfers``) and as
``transfer_*`` events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nacl.signing import SigningKey

from meshllm.errors import DecodeError, MeshllmError
from meshllm.identity.ids import short
from meshllm.models.bulk import BulkClient, BulkServer, BulkUnavailable
from meshllm.models.gguf_file import GGUFFile
from meshllm.models.library import MIN_PREFIX, AmbiguousModel, Library, LibraryEntry
from meshllm.models.manifest import Manifest, sign_manifest
from meshllm.models.refs import SHORT_HASH, ModelNotFound, file_sha256
from meshllm.models.stage_file import Layout, stage_layout, whole_layout
from meshllm.models.transfer import (
    CONNECT_S,
    TransferFailed,
    TransferServer,
    TransferState,
    fetch,
    get_manifest,
    get_range,
    upload_pace,
)
from meshllm.net import Endpoint, NetError
from meshllm.net.errors import PeerMismatch
from meshllm.wire.addr import parse_addr

log = logging.getLogger(__name__)

Check = Callable[[GGUFFile], None]
"""``check(header)``: raise to refuse a stage before its bytes are fetched or loaded."""


@dataclass(frozen=True)
class Offer:
    """A peer offers a whole model file (from its peer record's ``models.available``)."""

    node_id: str
    addr: str
    model_id: str
    name: str
    size: int


Catalog = Callable[[], list[Offer]]
BulkPorts = Callable[[str], int]
"""``bulk_port(node_id)``: the TCP port of the peer's bulk channel from its record (0: it offers none)."""
QUIC_ONLY_S = 60.0
"""A peer whose bulk channel failed is fetched from over QUIC for this long before the channel is tried again."""
"""What the mesh offers now, best holders first (the node builds it from gossip)."""
MESH_WAIT_S = 30.0
"""How long ``serve --model NAME`` waits for a peer offering the model to show up in gossip."""
PROGRESS_EVENT_S = 1.0
"""At most one ``transfer_progress`` event per transfer per second."""
KEEP_FINISHED_S = 120.0
"""Finished transfers stay in the status this long."""


@dataclass
class TransferView:
    """One transfer as ``/api/status`` shows it."""

    model: str
    name: str
    kind: str
    layers: tuple[int, int] | None
    bytes_total: int = 0
    bytes_done: int = 0
    state: str = "fetching"
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    holders: dict[str, dict[str, Any]] = field(default_factory=dict)
    error: str | None = None
    last_event: float = 0.0
    fetched: int | None = None
    """Bytes taken from the sources, when it differs from ``bytes_done`` (refetched pieces count twice)."""

    def rate(self) -> int:
        """Bytes per second since the transfer started."""
        elapsed = (self.ended or time.monotonic()) - self.started
        return round(self.bytes_done / elapsed) if elapsed > 0 else 0

    def eta(self) -> float | None:
        """Seconds left at the rate so far (None when done, or before any byte arrived)."""
        rate = self.rate()
        if self.ended is not None or not rate or not self.bytes_total:
            return None
        return round(max(0, self.bytes_total - self.bytes_done) / rate, 1)

    def json(self) -> dict[str, Any]:
        elapsed = (self.ended or time.monotonic()) - self.started
        return {"model": self.name, "id": self.model[:12], "kind": self.kind,
                "layers": list(self.layers) if self.layers else None, "state": self.state,
                "bytes_done": self.bytes_done, "bytes_total": self.bytes_total,
                "fetched": self.bytes_done if self.fetched is None else self.fetched,
                "rate_bytes_s": self.rate(), "eta_s": self.eta(),
                "elapsed_s": round(elapsed, 1), "holders": list(self.holders.values()), "error": self.error}


class ModelStore:
    """The library, served to peers and filled from them."""

    def __init__(self, library: Library, endpoint: Endpoint, signing_key: SigningKey, catalog: Catalog,
                 publish: Callable[..., Any], on_change: Callable[[], None] | None = None,
                 bulk_ports: BulkPorts | None = None, upload_bytes_s: float | None = None) -> None:
        """``on_change()`` is called when the library's whole models change (the peer record lists them);
        ``bulk_ports`` names peers' bulk channels (None: every transfer rides QUIC); ``upload_bytes_s``
        caps the rate this node sends model bytes to peers, both channels together (None: no cap)."""
        self.library = library
        self.endpoint = endpoint
        self.key = signing_key
        self.catalog = catalog
        self.publish = publish
        self.on_change = on_change
        self.transfers: dict[str, TransferView] = {}
        self._running: dict[str, asyncio.Task[LibraryEntry]] = {}
        pace = upload_pace(upload_bytes_s) if upload_bytes_s is not None else None
        self.server = TransferServer(endpoint, self.offered, self.signed_manifest, pace)
        self.bulk_ports = bulk_ports
        self.bulk = BulkClient(signing_key)
        self.bulk_server = BulkServer(signing_key, self.offered, lambda peer: peer in endpoint.peers, pace)
        self._quic_only: dict[str, float] = {}
        self.channels: dict[str, str] = {}
        """The channel the last piece from each holder came over: ``tcp`` (bulk) or ``quic``."""

    async def start_bulk(self, host: str, port: int = 0) -> int:
        """Open this node's bulk channel (TLS over TCP) on ``host:port``; returns the port to offer."""
        return await self.bulk_server.start(host, port)

    async def close(self) -> None:
        self.bulk.close()
        await self.bulk_server.close()

    async def get(self, node: str, addr: str, model: str, offset: int, length: int) -> bytes:
        """Bytes of ``model`` from holder ``node``: over its bulk channel when it offers one and our QUIC
        path to it is direct (dialled at the host that path reaches, once QUIC proved who it is), else
        and whenever that channel fails, over QUIC."""
        port = self.bulk_ports(node) if self.bulk_ports is not None else 0
        if port and self._quic_only.get(node, 0.0) <= time.monotonic():
            conn = await self.endpoint.connect(parse_addr(addr), node, timeout=CONNECT_S)
            if conn.path == "direct":
                try:
                    data = await self.bulk.get_range(node, conn.remote_addr[0], port, model, offset, length)
                except (BulkUnavailable, PeerMismatch) as exc:
                    log.warning("bulk channel to %s failed, using QUIC for %.0f s: %s", short(node), QUIC_ONLY_S, exc)
                    self._quic_only[node] = time.monotonic() + QUIC_ONLY_S
                    self.publish("transfer_channel_fallback", holder=node, reason=str(exc))
                else:
                    self.channels[node] = "tcp"
                    return data
        data = await get_range(self.endpoint, node, addr, model, offset, length)
        self.channels[node] = "quic"
        return data

    # -- what we offer ------------------------------------------------------------------------------

    def offered(self, model_id: str) -> Path | None:
        """The whole file of ``model_id`` this node offers to peers (every whole model of its library)."""
        entry = self.library.whole(model_id)
        return entry.file if entry is not None else None

    def signed_manifest(self, model_id: str) -> bytes:
        """This node's manifest of a model it holds, signed (blocking: hashes the file the first time)."""
        entry = self.library.whole(model_id)
        if entry is None:
            raise TransferFailed(f"this node does not hold model {model_id[:12]}")
        return sign_manifest(self.key, self.library.manifest(entry))

    def holders(self, model_id: str) -> list[tuple[str, str]]:
        """Peers offering ``model_id`` (node id, ``host:port``), best first."""
        return [(o.node_id, o.addr) for o in self.catalog() if o.model_id == model_id]

    def find_in_mesh(self, ref: str) -> Offer | None:
        """The model a peer offers under ``ref`` (an id, an id prefix, a name or ``name@prefix``)."""
        name, _, prefix = ref.strip().partition("@")
        offers = self.catalog()
        by_id = [o for o in offers if len(ref) >= MIN_PREFIX and o.model_id.startswith(ref)]
        matches = by_id or [o for o in offers if o.name == name and o.model_id.startswith(prefix)]
        ids = {o.model_id for o in matches}
        if len(ids) > 1:
            listing = ", ".join(sorted({f"{o.name}@{o.model_id[:SHORT_HASH]}" for o in matches}))
            raise AmbiguousModel(f"{ref!r} matches several models in the mesh: {listing}")
        return matches[0] if matches else None

    async def fetch_from_mesh(self, ref: str, wait_s: float = MESH_WAIT_S) -> LibraryEntry:
        """The whole model a peer offers under ``ref``, fetched into the library (waiting for gossip)."""
        deadline = time.monotonic() + wait_s
        while (offer := self.find_in_mesh(ref)) is None:
            if time.monotonic() > deadline:
                raise ModelNotFound(f"no model {ref!r} here, in the library or in the mesh (waited {wait_s:.0f} s)",
                                    hint="`meshllm models list` shows what this node and its peers have")
            await asyncio.sleep(0.5)
        return await self.whole_file(offer.model_id, offer.name)

    def hub_reporter(self, spec: str) -> Callable[[int, int], None]:
        """A progress callback for a Hugging Face download (called from its threads) that feeds the status."""
        return self.reporter(self.begin_view(spec, spec, spec, "download", None))

    def begin_view(self, key: str, model: str, name: str, kind: str, layers: tuple[int, int] | None) -> TransferView:
        """A new transfer in the status (replacing an earlier one under ``key``)."""
        view = TransferView(model, name, kind, layers)
        self.transfers[key] = view
        return view

    def reporter(self, view: TransferView) -> Callable[[int, int], None]:
        """``report(done, total)`` for a fetch running in threads: updates ``view`` and publishes
        ``transfer_progress`` at most once a second, on the event loop."""
        loop = asyncio.get_running_loop()

        def update(done: int, total: int) -> None:
            def apply() -> None:
                view.bytes_done, view.bytes_total = done, total
                now = time.monotonic()
                if now - view.last_event >= PROGRESS_EVENT_S or done == total:
                    view.last_event = now
                    self.publish("transfer_progress", model=view.name, id=view.model, kind=view.kind,
                                 layers=list(view.layers) if view.layers else None, bytes_done=done,
                                 bytes_total=total, rate_bytes_s=view.rate())
            loop.call_soon_threadsafe(apply)

        return update

    def end_view(self, view: TransferView, *, error: str | None = None, fetched: int | None = None) -> None:
        """A transfer of ``view`` finished (``fetched``: bytes it took from its sources) or failed."""
        view.state, view.ended, view.error = ("failed" if error else "done"), time.monotonic(), error
        if fetched is not None:
            view.fetched = fetched
        if error:
            self.publish("transfer_failed", model=view.name, id=view.model, kind=view.kind,
                         layers=list(view.layers) if view.layers else None, reason=error)
        else:
            self.publish("transfer_done", model=view.name, id=view.model, kind=view.kind,
                         layers=list(view.layers) if view.layers else None, bytes=view.bytes_done,
                         fetched=view.fetched, took_s=round(view.ended - view.started, 3))

    def download_ended(self, spec: str, error: str | None = None) -> None:
        view = self.transfers.get(spec)
        if view is not None:
            view.state, view.ended, view.error = ("failed" if error else "done"), time.monotonic(), error
        if error is None and self.on_change is not None:
            self.on_change()

    def changed(self) -> None:
        """The library's whole models changed (a model was added or removed)."""
        if self.on_change is not None:
            self.on_change()

    # -- status -------------------------------------------------------------------------------------

    def status(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        for key, view in list(self.transfers.items()):
            if view.ended is not None and now - view.ended > KEEP_FINISHED_S:
                del self.transfers[key]
        return [v.json() for v in self.transfers.values()]

    def _progress(self, view: TransferView, names: Mapping[str, str]) -> Callable[[TransferState], None]:
        def update(state: TransferState) -> None:
            view.bytes_done, view.bytes_total = state.done_bytes, state.total_bytes
            for node, h in state.holders.items():
                before = view.holders.get(node, {}).get("dropped")
                view.holders[node] = {"node_id": node, "name": names.get(node, short(node)), "bytes": h.bytes,
                                      "dropped": h.dropped, "bad": h.bad, "channel": self.channels.get(node)}
                if h.dropped and not before:
                    self.publish("transfer_holder_dropped", model=view.name, id=view.model,
                                 layers=list(view.layers) if view.layers else None, holder=node,
                                 reason=h.dropped, bad_bytes=h.bad)
            now = time.monotonic()
            if now - view.last_event >= PROGRESS_EVENT_S or state.finished:
                view.last_event = now
                self.publish("transfer_progress", model=view.name, id=view.model, kind=view.kind,
                             bytes_done=state.done_bytes, bytes_total=state.total_bytes)
        return update

    # -- what we fetch ------------------------------------------------------------------------------

    async def stage_file(self, manifest: Manifest, name: str, start: int, end: int,
                         first: list[tuple[str, str]], names: Mapping[str, str] | None = None,
                         check: Check | None = None) -> LibraryEntry:
        """A file holding layers ``[start, end)`` of ``manifest``'s model: the whole model if the
        library has it, a stage file it holds, or one fetched now from ``first`` (the coordinator)
        and every other holder.

        ``check(header)`` sees the model's header before anything is fetched (or the file found) and
        raises to refuse (a worker's memory quota, say).
        """
        found = self.library.whole(manifest.model) or self.library.stage(manifest.model, start, end)
        if found is not None:
            if check is not None:
                await asyncio.to_thread(check, GGUFFile(found.file))
            self.library.touch(found)
            return found
        key = f"{manifest.model}:{start}-{end}"
        names = {} if names is None else names
        return await self._once(key, lambda: self._fetch_stage(manifest, name, start, end, first, names, check))

    async def whole_file(self, model_id: str, name: str, names: Mapping[str, str] | None = None) -> LibraryEntry:
        """The whole model ``model_id``, fetched from the peers that hold it unless the library has it."""
        whole = self.library.whole(model_id)
        if whole is not None:
            return whole
        return await self._once(model_id, lambda: self._fetch_whole(model_id, name, {} if names is None else names))

    async def _once(self, key: str, start: Callable[[], Any]) -> LibraryEntry:
        """One transfer per file at a time: a second request for it waits for the first."""
        task = self._running.get(key)
        if task is None:
            task = asyncio.ensure_future(start())
            self._running[key] = task
            task.add_done_callback(lambda _t: self._running.pop(key, None))
        return await asyncio.shield(task)

    async def _fetch_stage(self, manifest: Manifest, name: str, start: int, end: int,
                           first: list[tuple[str, str]], names: Mapping[str, str], check: Check | None) -> LibraryEntry:
        holders = _unique([*first, *self.holders(manifest.model)])
        view = TransferView(manifest.model, name, "stage", (start, end))
        self.transfers[f"{manifest.model}:{start}-{end}"] = view
        self.publish("transfer_started", model=name, id=manifest.model, kind="stage", layers=[start, end],
                     holders=[h for h, _ in holders])
        try:
            header = await self._header(manifest, holders)

            def layout_of() -> Layout:  # parses a header of megabytes (a big vocabulary): off the event loop
                if check is not None:
                    check(GGUFFile(f"model {manifest.model[:12]}", header=header, size=manifest.size))
                return stage_layout(manifest, header, start, end, name)

            layout = await asyncio.to_thread(layout_of)
            part = self.library.incoming(f"{manifest.model}.{start}-{end}.part")
            await asyncio.to_thread(self.library.reserve, layout.fetch_bytes + len(layout.header or b""))
            state = await fetch(self.get, manifest, layout, holders, part, progress=self._progress(view, names),
                                more=lambda: self.holders(manifest.model))
            entry = self.library.commit(part, model_id=manifest.model, name=name, source=_source(state),
                                        layers=(start, end))
        except (MeshllmError, OSError) as exc:
            return self._failed(view, exc)
        return self._done(view, entry)

    async def _fetch_whole(self, model_id: str, name: str, names: Mapping[str, str]) -> LibraryEntry:
        holders = _unique(self.holders(model_id))
        view = TransferView(model_id, name, "whole", None)
        self.transfers[model_id] = view
        self.publish("transfer_started", model=name, id=model_id, kind="whole", layers=None,
                     holders=[h for h, _ in holders])
        part = self.library.incoming(f"{model_id}.part")
        refused: list[str] = []
        liars: set[str] = set()
        try:
            for node, addr in holders:  # each holder's manifest in turn, until one adds up to the id
                try:
                    manifest, _signed = await get_manifest(self.endpoint, node, addr, model_id)
                except (NetError, DecodeError, MeshllmError) as exc:
                    refused.append(f"{short(node)}: {exc}")
                    liars.add(node)  # unreachable, or cannot describe the model: not a holder to fetch from
                    continue
                have = part.stat().st_blocks * 512 if part.exists() else 0
                await asyncio.to_thread(self.library.reserve, max(0, manifest.size - have))
                state = await fetch(self.get, manifest, whole_layout(manifest),
                                    [h for h in holders if h[0] not in liars], part,
                                    progress=self._progress(view, names),
                                    more=lambda: [h for h in self.holders(model_id) if h[0] not in liars])
                view.state = "verifying"
                digest = await asyncio.to_thread(file_sha256, part)
                if digest == model_id:
                    entry = self.library.commit(part, model_id=model_id, name=name, source=_source(state))
                    return self._done(view, entry)
                liars.add(node)
                refused.append(f"{short(node)}: its manifest describes another file (sha256 {digest[:12]})")
                self.publish("transfer_holder_dropped", model=name, id=model_id, layers=None, holder=node,
                             reason="its manifest does not add up to the model id", bad_bytes=True)
                view.state = "fetching"
            raise TransferFailed(f"no holder could provide model {model_id[:12]}: {'; '.join(refused) or 'none'}")
        except (MeshllmError, OSError) as exc:
            return self._failed(view, exc)

    async def _header(self, manifest: Manifest, holders: list[tuple[str, str]]) -> bytes:
        """The model's header (span 0), each piece checked, from the first holder that sends it right."""
        errors = []
        for node, addr in holders:
            try:
                parts = []
                for piece in manifest.pieces(0):
                    data = await self.get(node, addr, manifest.model, piece.offset, piece.length)
                    if not piece.check(data):
                        raise TransferFailed("its header does not match the manifest")
                    parts.append(data)
                return b"".join(parts)
            except (NetError, OSError, DecodeError, TransferFailed) as exc:
                errors.append(f"{short(node)}: {exc}")
        raise TransferFailed(f"no holder sent the header of model {manifest.model[:12]}: {'; '.join(errors)}")

    def _done(self, view: TransferView, entry: LibraryEntry) -> LibraryEntry:
        view.state, view.ended = "done", time.monotonic()
        if entry.kind == "whole":
            self.changed()
        took = view.ended - view.started
        self.publish("transfer_done", model=view.name, id=view.model, kind=view.kind,
                     layers=list(view.layers) if view.layers else None, bytes=view.bytes_done, took_s=round(took, 3),
                     path=entry.path, holders={h["node_id"]: h["bytes"] for h in view.holders.values()})
        return entry

    def _failed(self, view: TransferView, exc: BaseException) -> LibraryEntry:
        view.state, view.ended, view.error = "failed", time.monotonic(), str(exc)
        self.publish("transfer_failed", model=view.name, id=view.model, kind=view.kind, reason=str(exc))
        if isinstance(exc, MeshllmError):
            raise exc
        raise TransferFailed(str(exc)) from exc


def _unique(holders: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Holders in order, each once (the first address given for a node wins)."""
    seen: dict[str, tuple[str, str]] = {}
    for node, addr in holders:
        seen.setdefault(node, (node, addr))
    return list(seen.values())


def _source(state: TransferState) -> str:
    best = max(state.holders.values(), key=lambda h: h.bytes, default=None)
    return f"peer:{best.node_id}" if best is not None else "peer"

