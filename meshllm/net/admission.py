"""The admission exchange as a sans-IO state machine.

After TLS has proven both node ids, the dialer's first stream carries three frames::

    dialer   -- Hello{proof, observed}            --> acceptor   (acceptor runs admit)
    dialer  <-- Welcome{accepted, reason, proof, observed, grant} -- acceptor
    dialer   -- Confirm{accepted, reason}         --> acceptor   (after the dialer ran admit)

The acceptor serves the dialer's streams from the moment it accepts (Welcome); the dialer serves
the acceptor's streams from the moment it accepts the acceptor's proof, and the acceptor opens
streams only after Confirm, so neither side ever sees an honest peer's stream before it admitted
that peer. ``admit`` is the injected check (from the mesh layer): it returns to accept and raises
a :class:`~meshllm.errors.MeshllmError` to refuse, whose text becomes the reason. What the
acceptor's ``admit`` returns travels to the dialer as ``Welcome.grant`` and is handed to the
dialer's ``take_grant`` (the mesh layer's admission grant; opaque here), which may refuse too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import Enum

from meshllm.errors import MeshllmError
from meshllm.net.messages import Addr, AdmissionMessage, Confirm, Hello, Welcome

log = logging.getLogger(__name__)

AdmitProof = Callable[[bytes], "bytes | None"]
"""``admit`` bound to the peer's node id: raises MeshllmError to refuse the proof; an acceptor's
may return bytes for the dialer (its grant)."""
TakeGrant = Callable[[bytes], None]
"""The dialer's handler for ``Welcome.grant``: raises MeshllmError to refuse."""


class Phase(Enum):
    """Where the exchange stands."""

    START = "start"
    AWAIT_WELCOME = "await-welcome"
    AWAIT_HELLO = "await-hello"
    AWAIT_CONFIRM = "await-confirm"
    ADMITTED = "admitted"
    REFUSED = "refused"


class AdmissionError(MeshllmError):
    """The peer broke the exchange (wrong message for the phase)."""


class Admission:
    """One side of the admission exchange. Feed it messages; send what it returns."""

    def __init__(self, *, dialer: bool, local_proof: bytes, admit: AdmitProof, peer_addr: Addr,
                 take_grant: TakeGrant | None = None, passive: bool = False) -> None:
        self.dialer = dialer
        self.passive = passive
        """We are a passive client: our Hello says so."""
        self.peer_passive = False
        """The dialer said it is a passive client (acceptor side, once its Hello arrived)."""
        self.phase = Phase.START if dialer else Phase.AWAIT_HELLO
        self.refusal: str | None = None
        """Why admission failed (either side's reason), once ``phase`` is REFUSED."""
        self.refused_by_peer = False
        self.observed: Addr | None = None
        """Our own address as the peer sees it, once the peer has said."""
        self.serving = False
        """True once we admitted the peer: its streams may reach handlers."""
        self._proof = local_proof
        self._admit = admit
        self._take_grant = take_grant
        self._peer_addr = peer_addr

    @property
    def done(self) -> bool:
        return self.phase in (Phase.ADMITTED, Phase.REFUSED)

    def start(self) -> list[AdmissionMessage]:
        """Dialer: the opening Hello."""
        if not self.dialer or self.phase is not Phase.START:
            raise AdmissionError("only a dialer starts admission, once")
        self.phase = Phase.AWAIT_WELCOME
        return [Hello(proof=self._proof, observed=self._peer_addr, passive=self.passive)]

    def receive(self, message: AdmissionMessage) -> list[AdmissionMessage]:
        """Advance on one message from the peer; returns the messages to answer with."""
        if isinstance(message, Hello) and self.phase is Phase.AWAIT_HELLO:
            self.observed = tuple(message.observed)  # type: ignore[assignment]
            self.peer_passive = message.passive
            reason, grant = self._check(message.proof)
            if reason is not None:
                self._refuse(reason, by_peer=False)
                return [Welcome(accepted=False, reason=reason, proof=b"", observed=self._peer_addr)]
            self.phase = Phase.AWAIT_CONFIRM
            self.serving = True
            return [Welcome(accepted=True, reason="", proof=self._proof, observed=self._peer_addr, grant=grant)]
        if isinstance(message, Welcome) and self.phase is Phase.AWAIT_WELCOME:
            self.observed = tuple(message.observed)  # type: ignore[assignment]
            if not message.accepted:
                self._refuse(message.reason, by_peer=True)
                return []
            reason, _ = self._check(message.proof)
            if reason is None and self._take_grant is not None:
                reason = self._guard(lambda: self._take_grant(message.grant))  # type: ignore[misc]
            if reason is not None:
                self._refuse(reason, by_peer=False)
                return [Confirm(accepted=False, reason=reason)]
            self.phase = Phase.ADMITTED
            self.serving = True
            return [Confirm(accepted=True, reason="")]
        if isinstance(message, Confirm) and self.phase is Phase.AWAIT_CONFIRM:
            if not message.accepted:
                self.serving = False
                self._refuse(message.reason, by_peer=True)
                return []
            self.phase = Phase.ADMITTED
            return []
        raise AdmissionError(f"unexpected {type(message).__name__} in admission phase {self.phase.value}")

    def _check(self, proof: bytes) -> tuple[str | None, bytes]:
        """(why the peer's proof is refused or None, the grant ``admit`` gave it)."""
        grant = b""

        def run() -> None:
            nonlocal grant
            grant = self._admit(proof) or b""

        return self._guard(run), grant

    def _guard(self, check: Callable[[], None]) -> str | None:
        try:
            check()
        except MeshllmError as exc:
            return str(exc) or type(exc).__name__
        except Exception:
            log.exception("admission callback failed; refusing the peer")
            return "internal error while checking admission"
        return None

    def _refuse(self, reason: str, *, by_peer: bool) -> None:
        self.phase = Phase.REFUSED
        self.refusal = reason
        self.refused_by_peer = by_peer
