"""Wire messages of the transport itself and the QUIC error codes it uses.

Application messages travel in streams as frames (:mod:`meshllm.wire.frames`); these are the few
the transport adds: the admission exchange on the dialer's first stream, and the header frame
that names a stream's kind.
"""

from __future__ import annotations

from enum import IntEnum

import msgspec

Addr = tuple[str, int]
"""A UDP address as (host, port); IPv6 scope and flow info are dropped."""

HEADER_FRAME_MAX = 1024
"""Cap on a stream's first (kind) frame and on admission frames other than proofs."""
ADMISSION_FRAME_MAX = 256 * 1024
"""Cap on admission frames: proofs carry an invite and signatures, well under this."""
KIND_MAX = 64


class StreamOpen(msgspec.Struct, frozen=True):
    """First frame of every stream after admission: which handler serves it."""

    kind: str


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """Dialer -> acceptor, first frame of the first stream."""

    proof: bytes
    """Opaque admission proof (built by the mesh layer)."""
    observed: Addr
    """The address the dialer sends to, i.e. where it sees the acceptor."""
    passive: bool = False
    """The dialer is a passive client (``serve --client`` joining a mesh): it takes no part in gossip, so the
    acceptor neither gossips with it nor probes it, and holds nothing about it beyond the connection."""


class Welcome(msgspec.Struct, tag="welcome", frozen=True):
    """Acceptor -> dialer: the acceptor's verdict, and its own proof so the dialer can check it."""

    accepted: bool
    reason: str
    proof: bytes
    observed: Addr
    """The address the acceptor sees the dialer at."""
    grant: bytes = b""
    """Opaque: what the acceptor's ``admit`` gave the dialer (the mesh layer's admission grant)."""


class Confirm(msgspec.Struct, tag="confirm", frozen=True):
    """Dialer -> acceptor: the dialer's verdict on the acceptor's proof."""

    accepted: bool
    reason: str


AdmissionMessage = Hello | Welcome | Confirm


class CloseCode(IntEnum):
    """Application error codes in QUIC CONNECTION_CLOSE."""

    NORMAL = 0x0
    ADMISSION_REFUSED = 0x100
    PEER_MISMATCH = 0x101
    DUPLICATE = 0x102
    ADMISSION_TIMEOUT = 0x103
    PROTOCOL = 0x104
    MISBEHAVING = 0x105
    """The peer overstepped limits and is cooling down (refused for a while)."""


class ResetCode(IntEnum):
    """Application error codes in RESET_STREAM / STOP_SENDING."""

    CANCELLED = 0x10
    UNKNOWN_KIND = 0x11
    BAD_FRAME = 0x12
    NOT_ADMITTED = 0x13
    HANDLER_FAILED = 0x14
    TIMEOUT = 0x15
    """A stream header or frame did not arrive within its deadline."""


def normalize_addr(addr: tuple[object, ...]) -> Addr:
    """(host, port) from a socket address of either family."""
    return (str(addr[0]), int(addr[1]))  # type: ignore[call-overload]


def is_virtual(addr: tuple[object, ...]) -> bool:
    """True for a relay circuit's address (see :func:`meshllm.net.circuit.virtual_addr`)."""
    return isinstance(addr[0], str) and addr[0].startswith("relay:")
