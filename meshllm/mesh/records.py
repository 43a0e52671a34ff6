"""Peer records: what each node says about itself, signed by its own key.

A record is the only source of truth about a node: every peer can verify any record it holds,
whether it got it first-hand or through gossip, because the record carries its node's signature,
its membership proof and its owner certificate. The sequence number orders versions; a node bumps it
on every change and on a refresh, so "newer" is simply "higher sequence".

Verification (:class:`RecordVerifier`) runs before anything is stored and raises one typed error per
rule, so the caller can log why and leave its state untouched. A record also carries the time it
was signed, and no copy older than :data:`RECORD_MAX_AGE_S` is accepted: sequences order versions,
the signed time bounds how long any version can circulate (no ghosts from replayed records).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Annotated, Literal

import msgspec
from nacl.signing import SigningKey

from meshllm.errors import DecodeError, MeshllmError, VerificationError, WrongDomain, WrongMesh, WrongSigner
from meshllm.identity.ids import node_id as node_id_of
from meshllm.identity.ids import node_public_key
from meshllm.identity.signing import CLOCK_SKEW_S, Signed, decode_signed, decode_struct, sign, verify_bytes

RECORD_DOMAIN = "peer-record"
RECORD_MAX = 64 * 1024
"""Cap on a record's signed wire size: bounds what one peer can make every member store and resend."""

Role = Literal["host", "worker", "client"]
RecordState = Literal["alive", "leaving"]
PathKind = Literal["direct", "punched", "relay"]

SEQ_LIMIT = 2**62
"""Exclusive bound on record and notice sequences: far above wall-clock milliseconds, far below the
2**64 msgpack can encode, so re-signing above any valid sequence can never overflow."""
Seq = Annotated[int, msgspec.Meta(ge=0, lt=SEQ_LIMIT)]
"""A sequence number as it may appear on the wire; decoding rejects anything outside the range."""
RECORD_MAX_AGE_S = 180.0
"""A record signed longer ago than this is refused. Live nodes re-sign every 30 s (the refresh)
and one that stops is dropped after 120 s, so only replays are ever this old: an old signed record
can never bring a node back once its tombstone (300 s) is gone. A record whose ``refresh`` promises
a longer period (large meshes) is accepted for that much longer: see :func:`max_age`."""
REFRESH_S = 30.0
"""The refresh period the age and silence limits are written for (a record's default ``refresh``)."""
REFRESH_MAX_S = 3600.0
"""Longest re-sign period a record may promise: bounds how long any copy of it circulates."""


class StaleRecord(VerificationError):
    """The record is not newer than the version we hold (or than its down/leave tombstone)."""


class ExpiredRecord(StaleRecord):
    """The record was signed more than :data:`RECORD_MAX_AGE_S` ago (or claims a future time)."""


class RecordTooLarge(DecodeError):
    """The record's signed encoding exceeds :data:`RECORD_MAX`."""


class SequenceOutOfRange(MeshllmError):
    """We were asked to sign a record whose sequence lies outside ``[0, SEQ_LIMIT)``."""


class Addresses(msgspec.Struct, frozen=True, kw_only=True):
    """Where a node can be reached."""

    listen: list[str] = []
    """Addresses the node's UDP socket is bound to (``host:port``)."""
    observed: list[str] = []
    """Addresses peers saw it coming from (its public side of a NAT)."""
    relay: list[str] = []
    """Relays that forward to it, as ``relay_node_id@host:port``."""
    bulk_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """TCP port of its bulk channel for model bytes (TLS on node keys; 0: none), dialled at the host
    a direct QUIC connection to it reaches (``models/bulk.py``)."""


class Capacity(msgspec.Struct, frozen=True, kw_only=True):
    """What the node can hold and how fast it computes; the planner's input."""

    ram_bytes: int = 0
    vram_bytes: int = 0
    cpu_cores: int = 0
    gflops: float = 0.0
    """Measured compute speed (a short matmul benchmark), not a datasheet figure."""


class ServedModel(msgspec.Struct, frozen=True, kw_only=True):
    """A model (or a layer range of one) that the node serves now."""

    name: str
    context: int
    layer_start: int = 0
    layer_end: int = 0
    """Exclusive end of the served layer range; 0 with ``layer_start`` 0 means the whole model."""
    engine: str = "llama.cpp"
    id: str = ""
    """The model id (sha256 of its GGUF, hex) when known; "" when the node has not hashed it."""
    tools: bool = False
    """Its chat template renders tools itself (what ``auto`` looks for in requests with tools)."""


class DiskModel(msgspec.Struct, frozen=True, array_like=True):
    """A whole model file the node has on disk and offers to peers (``model-fetch``)."""

    id: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
    name: Annotated[str, msgspec.Meta(max_length=200)]
    size: Annotated[int, msgspec.Meta(ge=0)]


MAX_AVAILABLE = 64
"""Most models on disk a record lists (the most recently used first): bounds the record's size."""


def takes_requests(model: ServedModel) -> bool:
    """Whether the node answers requests for ``model``: it serves it whole, or coordinates a split of it.

    A worker's ``stage`` entry (one layer range of someone else's chain) takes no requests.
    """
    return model.engine == "split" or (model.engine != "stage" and model.layer_start == 0 and model.layer_end == 0)


class Models(msgspec.Struct, frozen=True, kw_only=True):
    """Served models and the model files on disk, which peers may fetch."""

    served: list[ServedModel] = []
    available: Annotated[list[DiskModel], msgspec.Meta(max_length=MAX_AVAILABLE)] = []


class Load(msgspec.Struct, frozen=True, kw_only=True):
    """Current work, for the router's load ordering."""

    in_flight: int = 0
    queue: int = 0
    """Requests waiting for a slot."""
    tok_s: float = 0.0
    slots: int = 0
    """Requests the node's engines can generate at once (0: a node too old to say)."""
    free_slots: int = 0
    """Of ``slots``, those free now: a request routed here starts at once."""


ModelName = Annotated[str, msgspec.Meta(max_length=200)]
"""A model id as demand and standby entries carry it (longer names are never tracked)."""
Count = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
UnixTime = Annotated[float, msgspec.Meta(ge=0.0, le=1e11)]
"""A finite wall-clock time (NaN and infinities fail the bounds at decode)."""
MAX_DEMAND = 32
"""Most models a record's demand map and standby list name: bounds what one peer makes every member hold."""


class DemandEntry(msgspec.Struct, frozen=True, array_like=True):
    """Requests for one model that the record's node could not serve locally (``mesh/demand.py``)."""

    model: ModelName
    requests: Count
    """Such requests in the last demand window (60 s) before the record was signed."""
    unmet: Count
    """Of them, those nobody could take: no node serves the model, or every one refused (no capacity)."""
    last_active: UnixTime
    """Unix time of the latest such request."""


RttMs = Annotated[float, msgspec.Meta(ge=0.0, le=3_600_000.0)]
"""A round trip in milliseconds as it may appear on the wire (finite, non-negative: the planner adds them)."""


class RttEntry(msgspec.Struct, frozen=True, array_like=True):
    """Measured round trip from the record's node to one peer."""

    rtt_ms: RttMs
    path: PathKind


class PeerRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One node's signed self-description, gossiped to every member."""

    node_id: str
    mesh_id: str
    seq: Seq
    """Strictly increasing per node; bumped on every change and on every refresh."""
    membership_proof: bytes
    owner_cert: bytes | None = None
    name: str = ""
    addresses: Addresses = Addresses()
    role: Role = "host"
    capacity: Capacity = Capacity()
    models: Models = Models()
    load: Load = Load()
    rtt: dict[str, RttEntry] = {}
    version: str = ""
    state: RecordState = "alive"
    signed_at: float = 0.0
    """Wall-clock time the node signed this version: bounds how long any copy of it is accepted."""
    demand: Annotated[list[DemandEntry], msgspec.Meta(max_length=MAX_DEMAND)] = []
    """The node's own demand map: what its clients asked for that it does not serve itself."""
    standby: Annotated[list[ModelName], msgspec.Meta(max_length=MAX_DEMAND)] = []
    """Models this node would start serving on demand (``serve --standby``); empty: not a standby."""
    refresh: Annotated[float, msgspec.Meta(ge=0, le=REFRESH_MAX_S)] = REFRESH_S
    """Seconds the node may wait before re-signing an unchanged record: large meshes re-sign less
    often, so that refreshes cost each member a bounded rate, not one per peer. (Liveness is not
    this: failure detection is local, ``mesh/failure.py``.)"""


def max_age(record: PeerRecord, base: float = RECORD_MAX_AGE_S) -> float:
    """Oldest signature accepted on ``record``: ``base`` plus however much its refresh exceeds 30 s."""
    return base + max(0.0, record.refresh - REFRESH_S)


def sign_record(key: SigningKey, record: PeerRecord) -> bytes:
    """Signed wire bytes of our own record; refuses what receivers would refuse."""
    if node_id_of(bytes(key.verify_key)) != record.node_id:
        raise WrongSigner("a peer record must be signed by the key its node id names")
    if not 0 <= record.seq < SEQ_LIMIT:
        raise SequenceOutOfRange(f"peer record seq {record.seq} is outside [0, 2**62)")
    raw = msgspec.msgpack.encode(sign(key, RECORD_DOMAIN, record))
    if len(raw) > RECORD_MAX:
        raise RecordTooLarge(f"peer record of {len(raw)} bytes exceeds the {RECORD_MAX}-byte cap")
    return raw


def decode_record(raw: bytes) -> tuple[Signed, PeerRecord]:
    """Parse (not verify) a record: size cap, container, body. Raises only :class:`DecodeError`s."""
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise DecodeError("a peer record must be bytes")
    if len(raw) > RECORD_MAX:
        raise RecordTooLarge(f"peer record of {len(raw)} bytes exceeds the {RECORD_MAX}-byte cap")
    signed = decode_signed(bytes(raw), what="peer record")
    return signed, decode_struct(signed.body, PeerRecord, what="peer record")


class SignatureCache:
    """Remembers signed bytes that verified, so identical bytes are checked once.

    Gossip hands the same record to a node several times (from several peers); Ed25519 verification
    is the dominant cost of accepting one. Only successes are cached, keyed by the exact bytes
    (signer, body and signature), so a cache hit proves the same check passed before.
    """

    def __init__(self, size: int = 8192) -> None:
        self._size = size
        self._ok: OrderedDict[bytes, None] = OrderedDict()

    def check(self, signed: Signed, raw: bytes) -> None:
        """Raise :class:`~meshllm.errors.BadSignature` unless ``signed`` verifies (or did before)."""
        if raw in self._ok:
            self._ok.move_to_end(raw)
            return
        verify_bytes(signed.signer, signed.domain, signed.body, signed.sig)
        self._ok[raw] = None
        if len(self._ok) > self._size:
            self._ok.popitem(last=False)


CheckMember = Callable[[str, bytes, float], object]
"""``check_member(node_id, proof, now)``: raise a VerificationError unless the proof admits the node
(whatever it returns is not used here)."""
ForgetMember = Callable[[str], None]
"""``forget_member(node_id)``: the node left our table (it no longer counts towards any quota)."""
CheckTrust = Callable[[str, "bytes | None", float], object]
"""``check_trust(node_id, owner_cert, now)``: raise a VerificationError unless local policy accepts it
(whatever it returns, e.g. a trust decision, is not used here)."""
HeldSeq = Callable[[str], "int | None"]
"""The sequence held for a node id (tombstones included), or None: the staleness bar."""


class RecordVerifier:
    """Every check a record must pass before it is stored, in cheapest-first order.

    Staleness is checked before the signer and the signature: gossip delivers many copies of
    versions we already hold, and rejecting them should cost no more than a decode. Membership
    and trust callbacks come from ``mesh.admission`` and ``identity.trust``; this module never
    imports them (they sit beside it, not below it).
    """

    def __init__(
        self,
        mesh_id: str,
        check_member: CheckMember,
        check_trust: CheckTrust,
        cache: SignatureCache | None = None,
        max_age_s: float = RECORD_MAX_AGE_S,
        forget_member: ForgetMember | None = None,
    ) -> None:
        self.mesh_id = mesh_id
        self._check_member = check_member
        self._check_trust = check_trust
        self._forget_member = forget_member
        self.cache = cache if cache is not None else SignatureCache()
        self.max_age_s = max_age_s

    def check_member(self, node_id: str, proof: bytes, now: float) -> None:
        """Re-run the membership check alone (after a revocation, on records already stored)."""
        self._check_member(node_id, proof, now)

    def check_credential(self, node_id: str, proof: bytes, owner_cert: bytes | None, now: float) -> None:
        """The membership and trust checks a record's credential passes, for other signed objects
        that carry one (blackboard notes)."""
        self._check_member(node_id, proof, now)
        self._check_trust(node_id, owner_cert, now)

    def forget(self, node_id: str) -> None:
        """``node_id`` left the table (see :data:`ForgetMember`)."""
        if self._forget_member is not None:
            self._forget_member(node_id)

    def verify(self, raw: bytes, now: float, held: HeldSeq | None = None) -> PeerRecord:
        """The verified record in ``raw``; ``held(node_id)`` is the sequence we already hold, if any."""
        signed, record = decode_record(raw)
        held_seq = None if held is None else held(record.node_id)
        if signed.domain != RECORD_DOMAIN:
            raise WrongDomain(f"expected a {RECORD_DOMAIN!r} signature, got {signed.domain!r}")
        if held_seq is not None and record.seq <= held_seq:
            raise StaleRecord(f"record {record.node_id[:8]} seq {record.seq} is not newer than {held_seq}")
        if not now - max_age(record, self.max_age_s) <= record.signed_at <= now + CLOCK_SKEW_S:
            raise ExpiredRecord(f"record {record.node_id[:8]} was signed {now - record.signed_at:.0f} s ago")
        if signed.signer != node_public_key(record.node_id):
            raise WrongSigner(f"record for {record.node_id[:8]} is signed by another key")
        self.cache.check(signed, bytes(raw))
        if record.mesh_id != self.mesh_id:
            raise WrongMesh(f"record {record.node_id[:8]} belongs to mesh {record.mesh_id[:12]!r}")
        self._check_member(record.node_id, record.membership_proof, now)
        self._check_trust(record.node_id, record.owner_cert, now)
        return record
