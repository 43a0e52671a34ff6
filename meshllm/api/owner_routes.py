"""HTTP routes for owner commands and for loading and unloading models on this node.

- ``POST /api/owner/relay {"envelope", "timeout_s"}``: deliver a command envelope sealed elsewhere
  (``meshllm owner`` seals it with the owner key in the CLI process) to the node it is addressed
  to, this one included, and return that node's signed result envelope. The node never sees the
  owner key.
- ``POST /api/owner/command {"node", "op", ...}``: the same for a caller without the key (the web
  console): this node unlocks the owner keystore in its home with the passphrase given (or
  ``$MESHLLM_OWNER_PASSPHRASE`` in its environment), seals the command, forgets the key, delivers
  it and returns the opened, checked result.
- ``POST /api/models/load {"model"}`` and ``POST /api/models/unload {"model", "timeout_s"}``: hot
  load and unload on this node itself, authorised by its admin token alone (no owner involved).

All four change state, so all need the admin token or an API key (``require_admin``). Fields a
route does not know are refused (422 naming them), never ignored.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import time
from collections.abc import Callable
from typing import Any, Literal

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from nacl.signing import SigningKey
from pydantic import BaseModel, ConfigDict, Field

from meshllm.api.auth import require_admin
from meshllm.engine.base import EngineError
from meshllm.errors import ConfigError, DecodeError, KeystoreError, MeshllmError, VerificationError
from meshllm.models.refs import ModelNotFound
from meshllm.owner.commands import (
    DEFAULT_TIMEOUT_S,
    MAX_TIMEOUT_S,
    OwnerCommand,
    envelope_target,
    open_result,
    pick_node,
    seal_command,
)
from meshllm.owner.relay import MAX_ENVELOPE, RelayError
from meshllm.owner.service import OwnerService
from meshllm.runtime.errors import error_body
from meshllm.runtime.serving import ModelNotServed

RELAY_MARGIN_S = 15.0
"""The relay waits this much longer than the command may take (hops, sealing, the answer's way back)."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RelayRequest(_Body):
    """Body of ``POST /api/owner/relay``."""

    envelope: str = Field(min_length=1, max_length=MAX_ENVELOPE * 2, description="the command envelope, base64")
    timeout_s: float = Field(default=DEFAULT_TIMEOUT_S + RELAY_MARGIN_S, gt=0, le=MAX_TIMEOUT_S + RELAY_MARGIN_S)


class CommandRequest(_Body):
    """Body of ``POST /api/owner/command``."""

    node: str = Field(min_length=1, max_length=200, description="node id, name or id prefix")
    op: Literal["load", "unload", "drain", "config", "status"]
    model: str = Field(default="", max_length=4096)
    key: str = Field(default="", max_length=64)
    value: str = Field(default="", max_length=1024)
    timeout_s: float = Field(default=DEFAULT_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)
    passphrase: str | None = Field(default=None, max_length=1024,
                                   description="of the owner keystore in this node's home")


class LoadRequest(_Body):
    """Body of ``POST /api/models/load``."""

    model: str = Field(min_length=1, max_length=4096, description="a GGUF path or 'default'")


class UnloadRequest(_Body):
    """Body of ``POST /api/models/unload``."""

    model: str = Field(min_length=1, max_length=200)
    timeout_s: float = Field(default=60.0, ge=0, le=MAX_TIMEOUT_S,
                             description="how long requests in flight may take to finish")


def b64decode(text: str, what: str) -> bytes:
    """Standard or URL-safe base64, padded or not; :class:`DecodeError` otherwise."""
    raw = text.strip().replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise DecodeError(f"{what} is not base64") from exc


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def owner_router(owner: OwnerService, nodes: Callable[[], list[tuple[str, str]]],
                 unlock: Callable[[str | None], SigningKey]) -> APIRouter:
    """Routes over ``owner``; ``nodes()`` lists the mesh's ``(node id, name)``; ``unlock(passphrase)``
    opens the owner keystore in the node's home (blocking: called in a worker thread)."""
    router = APIRouter()
    serving = owner.serving

    @router.post("/api/owner/relay", response_model=None, dependencies=[Depends(require_admin)])
    async def relay(body: RelayRequest) -> dict[str, Any] | JSONResponse:
        try:
            envelope = b64decode(body.envelope, "envelope")
            target = envelope_target(envelope)
        except DecodeError as exc:
            return _error(exc, 422, "invalid_envelope", "envelope")
        try:
            result = await owner.relay.deliver(envelope, target, body.timeout_s)
        except RelayError as exc:
            return _error(exc, 502, "undeliverable")
        return {"node": target, "result": b64encode(result)}

    @router.post("/api/owner/command", response_model=None, dependencies=[Depends(require_admin)])
    async def command(body: CommandRequest) -> dict[str, Any] | JSONResponse:
        try:
            target = pick_node(body.node, nodes())
            order = OwnerCommand(op=body.op, model=body.model, key=body.key, value=body.value,
                                 timeout_s=body.timeout_s)
            key = await asyncio.to_thread(unlock, body.passphrase)
            envelope = seal_command(key, target, order, time.time())
        except KeystoreError as exc:
            return _error(exc, 409, "owner_key_unavailable", "passphrase")
        except DecodeError as exc:
            return _error(exc, 422, "invalid_command")
        try:
            sealed = await owner.relay.deliver(envelope, target, body.timeout_s + RELAY_MARGIN_S)
            result = open_result(key, sealed, envelope, target, time.time())
        except RelayError as exc:
            return _error(exc, 502, "undeliverable")
        except (DecodeError, VerificationError) as exc:
            return _error(exc, 502, "bad_result")
        return {"node": target, "ok": result.ok, "code": result.code, "message": result.message, "data": result.data}

    @router.post("/api/models/load", response_model=None, dependencies=[Depends(require_admin)])
    async def load(body: LoadRequest) -> dict[str, Any] | JSONResponse:
        try:
            engine, fresh = await serving.load_model(body.model)
        except (ModelNotFound, DecodeError) as exc:
            return _error(exc, 422, "model_not_found", "model")
        except ConfigError as exc:
            return _error(exc, 409, "cannot_load")
        except EngineError as exc:
            return _error(exc, 422, "model_load_failed", "model")
        return {"model": engine.model_id, "engine": serving.loaded[engine.model_id], "context": engine.context_length,
                "loaded": fresh}

    @router.post("/api/models/unload", response_model=None, dependencies=[Depends(require_admin)])
    async def unload(body: UnloadRequest) -> dict[str, Any] | JSONResponse:
        try:
            return await serving.unload_model(body.model, body.timeout_s)
        except ModelNotServed as exc:
            return _error(exc, 409, "model_not_served", "model")

    return router


def _error(exc: MeshllmError, status: int, code: str, param: str | None = None) -> JSONResponse:
    message = f"{exc} ({exc.hint})" if exc.hint else str(exc)
    return JSONResponse(error_body(message, "invalid_request_error" if status < 500 else "server_error", code, param),
                        status_code=status)
