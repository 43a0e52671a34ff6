"""Stage control: a coordinator asks a worker to host a layer range (stream kind ``stage-control``).

One short stream per request: ``Host`` -> ``Hosted`` or ``Refused``; ``Release`` -> ``Released``.
The model file itself never travels: the worker loads ``path`` from its own disk and refuses unless
the file's sha256 equals the coordinator's, so two nodes never pair layers of different files (a
re-quantisation under the same name). Loading runs in a worker thread; the node keeps serving.
Only a node started with ``--worker`` answers (:class:`StageHost`); any other refuses at the stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta

from meshllm.engine.ggml import StageModel
from meshllm.errors import DecodeError, MeshllmError
from meshllm.models.refs import file_sha256
from meshllm.net import Endpoint, NetError, PeerConnection, Stream
from meshllm.split.errors import SplitError
from meshllm.split.frames import Layer
from meshllm.split.stage import StageServer
from meshllm.wire.addr import parse_addr

log = logging.getLogger(__name__)

KIND = "stage-control"
HOST_TIMEOUT_S = 60.0
"""Loading a range maps it (milliseconds) and copies what is repacked or offloaded (seconds for big models)."""

ModelName = Annotated[str, Meta(min_length=1, max_length=200)]


class Host(msgspec.Struct, frozen=True, kw_only=True, tag="host"):
    """Load layers [layer_start, layer_end) of the GGUF at ``path`` (same sha256) and serve them as ``model``."""

    model: ModelName
    path: Annotated[str, Meta(min_length=1, max_length=4096)]
    sha256: Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]
    layer_start: Layer
    layer_end: Layer
    max_context: Annotated[int, Meta(ge=1, le=1 << 24)]


class Release(msgspec.Struct, frozen=True, kw_only=True, tag="release"):
    """Stop serving ``model`` (a replan moved its layers elsewhere)."""

    model: ModelName


class Hosted(msgspec.Struct, frozen=True, kw_only=True, tag="hosted"):
    model: str
    layer_start: int
    layer_end: int


class Released(msgspec.Struct, frozen=True, kw_only=True, tag="released"):
    model: str


class Refused(msgspec.Struct, frozen=True, kw_only=True, tag="refused"):
    message: str


Request = Host | Release
Reply = Hosted | Released | Refused


class HostRefused(SplitError):
    """A worker would not (or could not) host the range it was asked for."""

    hint = "check that every node has the same model file at the same path (see docs/splits.md)"


class StageHost:
    """Worker side: answers ``stage-control`` streams by loading ranges into the node's :class:`StageServer`.

    ``on_change(model)`` tells the node that what it hosts changed (``hosted``: model -> Host), for its
    peer record. ``hash_cache`` (JSON, keyed by path, size and mtime) spares re-hashing the model file.
    """

    def __init__(
        self, server: StageServer, on_change: Callable[[str], None] | None = None,
        hash_cache: Path | None = None, load: Callable[[Path, int, int, int], StageModel] | None = None,
    ) -> None:
        self.server = server
        self.on_change = on_change
        self.hash_cache = hash_cache
        self.load = load or (lambda path, a, b, ctx: StageModel.load(path, a, b, max_context=ctx))
        """``load(path, layer_start, layer_end, max_context)``: the node's stage loader (threads, GPU layers)."""
        self.hosted: dict[str, Host] = {}
        server.endpoint.on_stream(KIND, self._serve)

    async def _serve(self, stream: Stream, peer: PeerConnection) -> None:
        request = await stream.recv(Request, timeout=5.0)
        if request is None:
            return
        try:
            reply: Reply = await self.handle(request)
        except (MeshllmError, OSError) as exc:
            reply = Refused(message=str(exc))
        log.info("stage-control from %s: %s -> %s", (peer.node_id or "?")[:12], type(request).__name__,
                 type(reply).__name__)
        await stream.send(reply)

    async def handle(self, request: Request) -> Reply:
        """Carry out one request; raises on a file that is missing, different or not loadable."""
        if isinstance(request, Release):
            self.server.unhost(request.model)
            self.hosted.pop(request.model, None)
            self._changed(request.model)
            return Released(model=request.model)
        path = Path(request.path)
        if not path.is_file():
            return Refused(message=f"no file at {path} on this worker")
        digest = await asyncio.to_thread(file_sha256, path, self.hash_cache)
        if digest != request.sha256:
            return Refused(message=f"{path} on this worker has sha256 {digest[:12]}, not {request.sha256[:12]}")
        stage = await asyncio.to_thread(self.load, path, request.layer_start, request.layer_end, request.max_context)
        self.server.host(request.model, stage)
        self.hosted[request.model] = request
        self._changed(request.model)
        return Hosted(model=request.model, layer_start=request.layer_start, layer_end=request.layer_end)

    def _changed(self, model: str) -> None:
        if self.on_change is not None:
            self.on_change(model)


async def ask(endpoint: Endpoint, node_id: str, addr: str, request: Request,
              timeout: float = HOST_TIMEOUT_S) -> Hosted | Released:
    """Send one control request to ``node_id`` at ``addr``; :class:`HostRefused` unless it succeeds."""
    try:
        conn = await endpoint.connect(parse_addr(addr), node_id, timeout=3.0)
        stream = await conn.open_stream(KIND)
        await stream.send(request)
        reply = await stream.recv(Reply, timeout=timeout)
    except (NetError, OSError, DecodeError) as exc:
        raise HostRefused(f"node {node_id[:12]} did not answer the stage request: {exc}") from None
    if reply is None or isinstance(reply, Refused):
        why = reply.message if reply is not None else "stream ended (is it a --worker?)"
        raise HostRefused(f"node {node_id[:12]} refused: {why}")
    return reply
