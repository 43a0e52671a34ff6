"""Owner commands and their results, sealed as signed envelopes (sans-IO).

A **command** is an :class:`OwnerCommand` in an envelope of kind :data:`COMMAND_KIND`, signed by the
owner key and encrypted to the target node (``identity/envelope.py``: the signature covers kind,
recipient, timestamp and nonce, so a command can be neither re-addressed, re-dated nor replayed).
A **result** is an :class:`OwnerResult` in an envelope of kind :data:`RESULT_KIND`, signed by the
target node's key. It names the command it answers by the digest of the command's envelope bytes,
so a result cannot be passed off as the answer to another command; it is encrypted to the owner
when the command opened, and travels in the clear (still signed) when it did not (a tampered
command names no trustworthy sender to encrypt to).
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal

import msgspec
from nacl.signing import SigningKey

from meshllm.errors import DecodeError, WrongSigner
from meshllm.identity.envelope import EnvelopeReceiver, OpenedEnvelope, decode_envelope, seal
from meshllm.identity.ids import node_id as node_id_of
from meshllm.identity.keys import NodeKey
from meshllm.identity.signing import decode_struct

COMMAND_KIND = "owner-command"
RESULT_KIND = "owner-result"
Op = Literal["load", "unload", "drain", "config", "status"]
OPS: tuple[str, ...] = ("load", "unload", "drain", "config", "status")
MAX_TIMEOUT_S = 600.0
"""Longest a command may ask its node to spend (loading a large model, draining long streams)."""
DEFAULT_TIMEOUT_S = 120.0
DIGEST_SIZE = 16

ModelRefText = Annotated[str, msgspec.Meta(max_length=4096)]
ConfigKey = Annotated[str, msgspec.Meta(max_length=64)]
ConfigValue = Annotated[str, msgspec.Meta(max_length=1024)]
Timeout = Annotated[float, msgspec.Meta(gt=0.0, le=MAX_TIMEOUT_S)]


class OwnerCommand(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the owner asks one node to do."""

    op: Op
    model: ModelRefText = ""
    """``load``: a model reference the node resolves itself (a path or ``default``); ``unload``: a
    served model id; ``drain``: empty for every model."""
    key: ConfigKey = ""
    """``config``: the setting (see ``owner/executor.py`` ``SETTINGS``)."""
    value: ConfigValue = ""
    """``config``: its new value, as text."""
    timeout_s: Timeout = DEFAULT_TIMEOUT_S
    """How long the node may take: a load, or waiting for requests in flight before an unload."""


class OwnerResult(msgspec.Struct, frozen=True, kw_only=True):
    """A node's answer to one command."""

    command: bytes
    """:func:`command_digest` of the command envelope this answers."""
    ok: bool
    code: str
    """``ok``, or why not: a refusal (``replayed``, ``expired``, ``tampered``, ``wrong_owner``,
    ``uncertified``, ...) or a failure (``failed``, ``unknown_model``, ...)."""
    message: str
    data: dict[str, Any] = {}
    """What the command reports (``status``: the node's serving state; ``load``: the model)."""


def check_command(command: OwnerCommand) -> OwnerCommand:
    """``command`` if its fields fit its op; :class:`DecodeError` naming the problem otherwise."""
    if command.op in ("load", "unload") and not command.model:
        raise DecodeError(f"an owner {command.op} command names a model")
    if command.op == "config" and not command.key:
        raise DecodeError("an owner config command names a setting (KEY=VALUE)")
    if command.op in ("status", "config") and command.model:
        raise DecodeError(f"an owner {command.op} command takes no model")
    if command.op != "config" and (command.key or command.value):
        raise DecodeError(f"an owner {command.op} command takes no setting")
    return command


def command_digest(envelope: bytes) -> bytes:
    """The id a result uses for the command envelope it answers."""
    return hashlib.blake2b(envelope, digest_size=DIGEST_SIZE).digest()


def seal_command(owner_key: SigningKey, target: str, command: OwnerCommand, now: float) -> bytes:
    """The envelope carrying ``command`` from the owner to node ``target`` (encrypted to it)."""
    payload = msgspec.msgpack.encode(check_command(command))
    return seal(NodeKey(owner_key), COMMAND_KIND, payload, now, recipient=target)


def decode_command(payload: bytes) -> OwnerCommand:
    """The command in an opened envelope's payload; :class:`DecodeError` if malformed."""
    return check_command(decode_struct(payload, OwnerCommand, "owner command"))


def seal_result(node_key: NodeKey, result: OwnerResult, now: float, owner: str | None) -> bytes:
    """The signed result envelope; encrypted to ``owner`` (a key in node-id form) when given."""
    return seal(node_key, RESULT_KIND, msgspec.msgpack.encode(result), now, recipient=owner)


def envelope_target(envelope: bytes) -> str:
    """The node a command envelope is addressed to (structure only; :class:`DecodeError` otherwise)."""
    env = decode_envelope(envelope)
    if env.kind != COMMAND_KIND or not env.recipient:
        raise DecodeError("not an owner command envelope addressed to a node")
    return node_id_of(env.recipient)


def open_result(owner_key: SigningKey, data: bytes, command_envelope: bytes, node: str, now: float) -> OwnerResult:
    """Check a result envelope completely: signed by ``node``, fresh, answering ``command_envelope``.

    Raises the envelope's typed errors, :class:`WrongSigner` when another node signed it, and
    :class:`DecodeError` when it answers another command or is malformed.
    """
    opened: OpenedEnvelope = EnvelopeReceiver(NodeKey(owner_key)).open(data, RESULT_KIND, now)
    if opened.sender != node:
        raise WrongSigner(f"the result is signed by node {opened.sender[:8]}, not by {node[:8]}")
    result = decode_struct(opened.payload, OwnerResult, "owner result")
    if result.command != command_digest(command_envelope):
        raise DecodeError("the result answers another command")
    return result


def pick_node(text: str, nodes: list[tuple[str, str]]) -> str:
    """The node id that ``text`` names among ``(node id, name)`` pairs: a whole id, a name, or an id prefix.

    Raises :class:`DecodeError` naming the candidates when ``text`` matches none or several.
    """
    wanted = text.strip()
    ids = [n for n, _ in nodes]
    if wanted.lower() in ids:
        return wanted.lower()
    named = [n for n, name in nodes if name == wanted]
    if len(named) == 1:
        return named[0]
    prefixed = [n for n in ids if len(wanted) >= 4 and n.startswith(wanted.lower())]
    matches = named or prefixed
    if len(matches) == 1:
        return matches[0]
    known = ", ".join(f"{name or n[:8]} ({n[:8]})" for n, name in nodes) or "none"
    if matches:
        raise DecodeError(f"{wanted[:64]!r} names {len(matches)} nodes", hint=f"use the node id; nodes: {known}")
    raise DecodeError(f"no node {wanted[:64]!r} in this mesh", hint=f"nodes: {known}")
