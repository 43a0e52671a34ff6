"""Wire messages of gossip and failure detection (msgspec tagged structs over msgpack).

One tagged union, :data:`MeshMessage`, so one gossip stream (or datagram) can carry any of them and
a decoder rejects anything else with a :class:`~meshllm.errors.DecodeError`. Records and down
notices travel as their signed bytes, untouched, so a receiver verifies exactly what the origin
signed, however many hops they crossed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import msgspec
from nacl.signing import SigningKey

from meshllm.errors import DecodeError, WrongDomain, WrongSigner
from meshllm.identity.ids import node_public_key
from meshllm.identity.signing import Signed, decode_signed, decode_struct, sign
from meshllm.mesh.records import Seq, SignatureCache
from meshllm.wire.frames import CONTROL_FRAME_MAX

NOTICE_DOMAIN = "down-notice"
NOTICE_MAX = 1024
REVOCATION_MAX = 1024
"""Bytes of one signed revocation record (a real one is about 250)."""
REVOCATIONS_PER_MESSAGE = 256
"""Revocation records one :class:`Revocations` message may carry (more are sent in several)."""


IDS_MAX = 65536
"""Node ids one digest or ``want`` list may name (decoding refuses more: each costs us work)."""


SUMMARY_LEVELS = 3
"""Levels of a summary: 16, 256 or 4,096 buckets (``meshllm.mesh.view.Table``)."""
BUCKETS_MAX = 16**SUMMARY_LEVELS


class Summary(msgspec.Struct, frozen=True, tag="summary"):
    """Anti-entropy opener: one 8-byte sum per bucket of the sender's table (itself included).

    A bucket's sum is the XOR of a hash of (node id, sequence, alive) over the records filed under
    it, so equal sums mean equal versions. The receiver answers with a :class:`Digest` of only the
    buckets whose sums differ, and nothing at all when none do: a converged mesh trades a few
    hundred bytes per round however large it is.
    """

    level: Annotated[int, msgspec.Meta(ge=1, le=SUMMARY_LEVELS)]
    sums: Annotated[bytes, msgspec.Meta(max_length=8 * BUCKETS_MAX)]
    """Little-endian unsigned 64-bit sums: of every bucket of ``level`` in order, or of ``buckets``."""
    buckets: Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=BUCKETS_MAX)]],
                       msgspec.Meta(max_length=BUCKETS_MAX)] = []
    """Empty: all buckets. Otherwise only these (the sub-buckets of those a coarser summary showed
    differ): the answer to a summary is a finer summary while buckets hold many records."""


class Digest(msgspec.Struct, frozen=True, tag="digest"):
    """The sequence of every record the sender holds (down/left ones included) in some buckets.

    ``level`` 0 covers the whole table; otherwise only ``buckets`` of that level (the answer to a
    :class:`Summary`): the receiver gives what the sender lacks there and asks for what it lacks.
    """

    seqs: Annotated[dict[str, Seq], msgspec.Meta(max_length=IDS_MAX)]
    level: Annotated[int, msgspec.Meta(ge=0, le=SUMMARY_LEVELS)] = 0
    buckets: Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=BUCKETS_MAX)]],
                       msgspec.Meta(max_length=BUCKETS_MAX)] = []


class Exchange(msgspec.Struct, frozen=True, tag="exchange"):
    """Records the receiver lacks, and the ids whose records the sender wants back.

    An answer to a digest carries both; the answer to an exchange's ``want`` has an empty ``want``,
    so a push-pull round is at most three messages and can never loop.
    """

    records: list[bytes]
    want: Annotated[list[str], msgspec.Meta(max_length=IDS_MAX)] = []


class Notices(msgspec.Struct, frozen=True, tag="notices"):
    """Signed down notices, flooded to connected peers once per (subject, sequence)."""

    notices: list[bytes]


class Revocations(msgspec.Struct, frozen=True, tag="revocations"):
    """Revocation records signed by the mesh key (docs/identity.md), as their signed bytes.

    Flooded once when new, and sent to every newly connected peer, so late joiners learn them.
    Both bounds are enforced at decode: a longer list or a larger record fails to decode.
    """

    records: Annotated[list[Annotated[bytes, msgspec.Meta(max_length=REVOCATION_MAX)]],
                       msgspec.Meta(max_length=REVOCATIONS_PER_MESSAGE)]


HEALTH_MAX = 8
"""Highest local-health score a probe message may carry (mesh/failure.py: timeouts stretch up to 9x)."""
Health = Annotated[int, msgspec.Meta(ge=0, le=HEALTH_MAX)]


class Ping(msgspec.Struct, frozen=True, tag="ping"):
    """Direct liveness probe; answered by an :class:`Ack` with the same nonce.

    ``health`` is the sender's local-health score (0: its loop keeps time): a peer that says it is
    overloaded gets longer to answer before it is suspected.
    """

    nonce: int
    health: Health = 0


class Ack(msgspec.Struct, frozen=True, tag="ack"):
    """Answer to a :class:`Ping` (or, relayed, to a :class:`PingReq`: ``health`` is then the target's)."""

    nonce: int
    health: Health = 0


class PingReq(msgspec.Struct, frozen=True, tag="ping-req"):
    """Ask the receiver to ping ``target`` for us and ack ``nonce`` if the target answers."""

    nonce: int
    target: str


MeshMessage = Summary | Digest | Exchange | Notices | Revocations | Ping | Ack | PingReq
PROBE_MESSAGES = (Ping, Ack, PingReq)
"""The failure detector's messages: each is one QUIC datagram, never on a gossip stream."""

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(MeshMessage)


def encode_message(message: MeshMessage) -> bytes:
    """msgpack bytes of one message (the frame codec adds the length prefix on streams)."""
    return _encoder.encode(message)


def decode_message(data: bytes) -> MeshMessage:
    """Parse one message; every failure is a :class:`DecodeError`."""
    if len(data) > CONTROL_FRAME_MAX:
        raise DecodeError(f"mesh message of {len(data)} bytes exceeds the control frame cap")
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, RecursionError) as exc:
        raise DecodeError(f"malformed mesh message: {exc}") from exc


class DownNotice(msgspec.Struct, frozen=True, array_like=True):
    """A member's signed claim that ``subject`` stopped answering at sequence ``subject_seq``.

    The sequence lets the subject refute: any record of it with a higher sequence outranks the
    notice. The reporter's signature makes the claim attributable (Mesh-LLM's third-party claims
    are not), so a misbehaving reporter can be identified and revoked.
    """

    subject: str
    subject_seq: Seq
    reporter: str
    ts: float


def sign_notice(key: SigningKey, notice: DownNotice) -> bytes:
    """Signed wire bytes of a down notice we report."""
    return msgspec.msgpack.encode(sign(key, NOTICE_DOMAIN, notice))


@dataclass(frozen=True)
class VerifiedNotice:
    """A down notice whose reporter signature checked out."""

    notice: DownNotice
    raw: bytes


def verify_notice(raw: bytes, cache: SignatureCache) -> VerifiedNotice:
    """Decode and check a notice's signature against its reporter's node id.

    Whether the reporter is a member in good standing is the caller's check (it holds the table).
    """
    if len(raw) > NOTICE_MAX:
        raise DecodeError(f"down notice of {len(raw)} bytes exceeds {NOTICE_MAX}")
    signed: Signed = decode_signed(raw, what="down notice")
    if signed.domain != NOTICE_DOMAIN:
        raise WrongDomain(f"expected a {NOTICE_DOMAIN!r} signature, got {signed.domain!r}")
    notice = decode_struct(signed.body, DownNotice, what="down notice")
    if signed.signer != node_public_key(notice.reporter):
        raise WrongSigner(f"down notice claims reporter {notice.reporter[:8]} but another key signed it")
    cache.check(signed, raw)
    return VerifiedNotice(notice, raw)
