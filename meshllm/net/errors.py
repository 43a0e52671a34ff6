"""Errors raised by the QUIC transport.

They subclass the project-wide hierarchy in :mod:`meshllm.errors` so the CLI can print any of
them as one line. Dial failures share :class:`ConnectError` so retry loops can catch one type;
the two permanent refusals (:class:`PeerMismatch`, :class:`AdmissionRefused`) are marked so
:func:`meshllm.net.backoff.dial_with_retry` does not hammer a peer that said no.
"""

from __future__ import annotations

from meshllm.errors import MeshllmError, VerificationError


class NetError(MeshllmError):
    """Base of transport errors."""


class ConnectError(NetError):
    """A dial did not produce an admitted connection (unreachable, handshake failed, closed early)."""

    permanent: bool = False
    """True when retrying the same dial cannot succeed (the peer refused us, or is someone else)."""


class ConnectTimeout(ConnectError, TimeoutError):
    """The handshake or admission exchange did not finish before the deadline."""


class AdmissionRefused(ConnectError):
    """The peer's ``admit`` callback (or ours, on its answer) refused; ``reason`` says why."""

    permanent = True

    def __init__(self, reason: str, hint: str | None = None) -> None:
        super().__init__(f"admission refused: {reason}", hint)
        self.reason = reason


class PeerMismatch(VerificationError, ConnectError):
    """The peer's TLS certificate carries another key than the node id we dialed."""

    permanent = True
    hint = "the address now belongs to another node; refresh the peer's address"


class StreamClosed(NetError):
    """A stream ended abnormally: reset by either side, a malformed frame, or its connection closed."""


class NetTimeout(NetError, TimeoutError):
    """A stream operation did not finish before its deadline."""


class AioquicIncompatible(NetError):
    """aioquic no longer has a private hook we rely on (see meshllm/net/tls.py and quic.py)."""

    hint = "pin aioquic to a version tested with meshllm (1.7.x) or update meshllm/net"
