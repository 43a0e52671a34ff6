"""The mesh blackboard: short signed notes every member keeps for two days (sans-IO core).

Agents and people leave notes for each other (``STATUS:``, ``QUESTION:``, ``FINDING:``, ``TIP:``,
``DONE:``). A note is signed by the node that posts it and carries that node's credential (the
membership proof and owner certificate its peer record carries), so every member checks it the way
it checks a record, whoever relays it: forged, foreign or non-member notes are refused, and a
certified node's notes name its owner. What a relay cannot do is alter, invent or revive a note.

Spreading (one message per ``blackboard`` stream, like gossip): a node that accepts a new note
announces its id (:class:`NoteIds`) to every connected peer but the one it came from; a peer that
lacks it asks (:class:`NoteWant`) and gets the note (:class:`Notes`). Newly connected peers trade
the ids of everything they hold, so late joiners catch up. Announcing ids first means an honest
peer never sends a note the receiver holds: a note that arrives again unasked is a *replay* and is
refused as one.

Refusals, each returned as :class:`Refused` with a code the driver reports as an event:
``too-large`` (text over :data:`TEXT_MAX` bytes, or a signed note over :data:`NOTE_MAX`),
``forged`` (bad signature, wrong signer or domain, undecodable), ``replayed``, ``wrong-mesh``,
``expired`` (signed more than :data:`LIFETIME_S` ago, or in the future), ``not-member`` (its
credential does not admit it here), ``rate`` (more than :data:`RATE_PER_MINUTE` notes by one
author in any minute of signed time). Bounds: :data:`PER_AUTHOR_MAX` notes per author and
:data:`TOTAL_MAX` in all (the oldest go first), and every forwarding peer's messages are rate
limited (an excess is an :class:`~meshllm.mesh.failure.Overstep`, a strike on its connection).
"""

from __future__ import annotations

import bisect
import hashlib
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

import msgspec
from nacl.signing import SigningKey

from meshllm.errors import DecodeError, MeshllmError
from meshllm.identity.ids import node_id as node_id_of
from meshllm.identity.ids import node_public_key
from meshllm.identity.signing import CLOCK_SKEW_S, decode_signed, decode_struct, encode_signed, sign, verify_bytes
from meshllm.mesh.failure import Overstep
from meshllm.mesh.scrub import scrub
from meshllm.net.limits import RateLimit

NOTE_DOMAIN = "blackboard-note"
TEXT_MAX = 4096
"""Bytes (UTF-8) of a note's text."""
NOTE_MAX = 24 * 1024
"""Bytes of a signed note: the text plus the author's credential (a grant chain and a certificate)."""
LIFETIME_S = 48 * 3600.0
RATE_PER_MINUTE = 10
"""Notes one author may sign within any 60 s (counted over signed times, so arrival order does not matter)."""
PER_AUTHOR_MAX = 200
TOTAL_MAX = 5000
SEEN_MAX = 20000
"""Ids of notes dropped before their lifetime ended (evicted), remembered to refuse their replays."""
IDS_PER_MESSAGE = 2048
NOTES_PER_MESSAGE = 32
MESSAGES_PER_S = 20.0
MESSAGE_BURST = 60.0
WANT_TIMEOUT_S = 10.0
"""A note asked for and not delivered within this long may be asked of another peer."""
KINDS = ("STATUS", "QUESTION", "FINDING", "TIP", "DONE")
NAME_MAX = 64

NoteId = Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]


class Note(msgspec.Struct, frozen=True, kw_only=True):
    """What the author signs: the text, when, and the credential that makes it a member."""

    author: Annotated[str, msgspec.Meta(max_length=64)]
    mesh_id: Annotated[str, msgspec.Meta(max_length=64)]
    name: Annotated[str, msgspec.Meta(max_length=NAME_MAX)] = ""
    ts: Annotated[float, msgspec.Meta(ge=0.0, le=1e11)]
    nonce: Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
    """Random: two notes with the same text and second are still two notes."""
    text: str
    membership_proof: bytes
    owner_cert: bytes | None = None


class NoteIds(msgspec.Struct, frozen=True, tag="note-ids"):
    """Ids of notes the sender holds (all of them when a peer connects, one when it learns a note)."""

    ids: Annotated[list[NoteId], msgspec.Meta(max_length=IDS_PER_MESSAGE)]


class NoteWant(msgspec.Struct, frozen=True, tag="note-want"):
    """Ids the sender lacks and asks for."""

    ids: Annotated[list[NoteId], msgspec.Meta(max_length=IDS_PER_MESSAGE)]


class Notes(msgspec.Struct, frozen=True, tag="notes"):
    """Signed notes, as their signed bytes (verified by the receiver exactly as the author signed them)."""

    notes: Annotated[list[Annotated[bytes, msgspec.Meta(max_length=NOTE_MAX)]],
                     msgspec.Meta(max_length=NOTES_PER_MESSAGE)]


BoardMessage = NoteIds | NoteWant | Notes


class BoardRefusal(MeshllmError):
    """A note was refused; ``code`` says why in one word (the codes are listed in the module docstring)."""

    def __init__(self, code: str, message: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.code = code


@dataclass(frozen=True, slots=True)
class HeldNote:
    """A verified note and what we know of it."""

    id: bytes
    note: Note
    raw: bytes
    owner: str | None
    """The owner key (base32) that certified its author, when the author presented a valid certificate."""

    @property
    def kind(self) -> str | None:
        """``STATUS``, ``QUESTION``, ... when the text starts with ``KIND:``."""
        head = self.note.text.lstrip().split(":", 1)[0].upper()
        return head if head in KINDS and ":" in self.note.text else None

    def json(self) -> dict[str, object]:
        n = self.note
        return {"id": self.id.hex(), "author": n.author, "name": n.name, "owner": self.owner, "ts": n.ts,
                "kind": self.kind, "text": n.text}


@dataclass(frozen=True, slots=True)
class Send:
    to: str
    message: BoardMessage


@dataclass(frozen=True, slots=True)
class Refused:
    """A note from ``source`` was refused: ``code`` and ``reason`` say why (``author`` when it decoded)."""

    source: str
    code: str
    reason: str
    author: str | None = None


@dataclass(frozen=True, slots=True)
class Accepted:
    """A new note from ``source`` (None: posted here) is stored."""

    note: HeldNote
    source: str | None


Output = Send | Refused | Accepted | Overstep
CheckAuthor = Callable[[str, bytes, "bytes | None", float], "str | None"]
"""``check_author(node_id, proof, owner_cert, now)``: raise a VerificationError unless the credential
admits the node as a member here (the record checks); return its certifying owner's key, or None."""


def note_id(raw: bytes) -> bytes:
    return hashlib.sha256(raw).digest()[:16]


def sign_note(key: SigningKey, note: Note) -> bytes:
    return encode_signed(sign(key, NOTE_DOMAIN, note))


def text_size_error(text: str) -> BoardRefusal | None:
    size = len(text.encode())
    if not text.strip():
        return BoardRefusal("empty", "a note needs some text")
    if size > TEXT_MAX:
        return BoardRefusal("too-large", f"a note's text is {size} bytes, over the {TEXT_MAX}-byte (4 KB) limit",
                            hint="post a summary; link to where the rest lives")
    return None


@dataclass(frozen=True)
class Query:
    """What :meth:`Blackboard.search` matches: every field that is set must hold."""

    words: tuple[str, ...] = ()
    """Each word (case-insensitive) must appear in the text or the author's name; ``KIND:`` words match the kind."""
    author: str | None = None
    """A node id, its prefix, or the author's name (case-insensitive)."""
    since: float | None = None
    """Unix time: notes signed at or after it."""
    kind: str | None = None
    limit: int = 20


def parse_words(text: str) -> tuple[tuple[str, ...], str | None]:
    """Search words and the kind a ``KIND:`` word names (``QUESTION: gpu`` -> (("gpu",), "QUESTION"))."""
    words, kind = [], None
    for word in re.findall(r"\S+", text):
        if word.endswith(":") and word[:-1].upper() in KINDS:
            kind = word[:-1].upper()
        else:
            words.append(word.lower())
    return tuple(words), kind


class Blackboard:
    """The notes this node holds, and the protocol that keeps them in step with its peers."""

    def __init__(self, node_id: str, mesh_id: str, check_author: CheckAuthor) -> None:
        self.node_id, self.mesh_id = node_id, mesh_id
        self._check_author = check_author
        self.notes: dict[bytes, HeldNote] = {}
        """Held notes by id."""
        self._order: list[tuple[float, bytes]] = []
        """(signed time, id) of every held note, sorted: the oldest go first."""
        self._by_author: dict[str, list[bytes]] = {}
        self._seen: OrderedDict[bytes, float] = OrderedDict()
        """Evicted ids -> signed time, until their lifetime ends."""
        self._wanted: dict[bytes, tuple[str, float]] = {}
        """Ids asked for -> (peer asked, when)."""
        self.connected: set[str] = set()
        self._rate: RateLimit[str] = RateLimit(MESSAGES_PER_S, MESSAGE_BURST)

    # --- posting and queries ---

    def post(self, key: SigningKey, text: str, name: str, proof: bytes, owner_cert: bytes | None,
             now: float) -> tuple[HeldNote, list[Output]]:
        """Scrub, sign, store and announce a note of ours; :class:`BoardRefusal` when it may not go out."""
        clean = scrub(text)
        error = text_size_error(clean)
        if error is not None:
            raise error
        if self._recent(self.node_id, now) >= RATE_PER_MINUTE:
            raise BoardRefusal("rate", f"this node posted {RATE_PER_MINUTE} notes in the last minute "
                                       f"(the limit is {RATE_PER_MINUTE} a minute)", hint="wait a little")
        note = Note(author=self.node_id, mesh_id=self.mesh_id, name=name[:NAME_MAX], ts=now, nonce=os.urandom(16),
                    text=clean, membership_proof=proof, owner_cert=owner_cert)
        raw = sign_note(key, note)
        if len(raw) > NOTE_MAX:
            raise BoardRefusal("too-large", f"the signed note is {len(raw)} bytes, over {NOTE_MAX}")
        out = self._ingest(raw, None, now)
        accepted = [o for o in out if isinstance(o, Accepted)]
        if not accepted:
            refused = next(o for o in out if isinstance(o, Refused))
            raise BoardRefusal(refused.code, refused.reason)
        return accepted[0].note, out

    def search(self, query: Query, now: float) -> list[HeldNote]:
        """Live notes matching ``query``, newest first, at most ``query.limit``."""
        who = (query.author or "").lower()
        found = []
        for _, nid in reversed(self._order):
            held = self.notes[nid]
            n = held.note
            if now - n.ts > LIFETIME_S:
                continue
            if query.since is not None and n.ts < query.since:
                continue
            if query.kind is not None and held.kind != query.kind.upper():
                continue
            if who and not (n.author.startswith(who) or n.name.lower() == who):
                continue
            haystack = f"{n.text}\n{n.name}".lower()
            if not all(w in haystack for w in query.words):
                continue
            found.append(held)
            if len(found) >= query.limit:
                break
        return found

    # --- inputs from the driver ---

    def peer_connected(self, peer: str) -> list[Output]:
        """A new connection: tell the peer every id we hold (it asks for what it lacks)."""
        self.connected.add(peer)
        ids = list(self.notes)
        return [Send(peer, NoteIds(ids[i:i + IDS_PER_MESSAGE])) for i in range(0, len(ids), IDS_PER_MESSAGE)]

    def peer_disconnected(self, peer: str) -> None:
        self.connected.discard(peer)
        self._wanted = {i: w for i, w in self._wanted.items() if w[0] != peer}

    def tick(self, now: float) -> None:
        """Drop notes (and remembered ids) past their lifetime, and wants nobody answered."""
        while self._order and now - self._order[0][0] > LIFETIME_S:
            self._drop(self._order[0][1], remember=False)
        if any(now - ts > LIFETIME_S for ts in self._seen.values()):
            self._seen = OrderedDict((i, ts) for i, ts in self._seen.items() if now - ts <= LIFETIME_S)
        self._wanted = {i: w for i, w in self._wanted.items() if now - w[1] <= WANT_TIMEOUT_S}

    def receive(self, source: str, message: BoardMessage, now: float) -> list[Output]:
        """One message from connected peer ``source``."""
        # Notes we asked this peer for cost it nothing (catching up may take many messages); anything
        # else (announcements, wants, notes nobody asked for) draws on its budget.
        asked = isinstance(message, Notes) and all(
            self._wanted.get(note_id(raw), ("",))[0] == source for raw in message.notes)
        if not asked and not self._rate.allow(source, now):
            return [Overstep(source, "blackboard messages faster than any honest peer sends them")]
        if isinstance(message, NoteIds):
            want = [i for i in dict.fromkeys(message.ids)
                    if i not in self.notes and i not in self._seen and i not in self._wanted]
            for i in want:
                self._wanted[i] = (source, now)
            return [Send(source, NoteWant(want))] if want else []
        if isinstance(message, NoteWant):
            held = [self.notes[i].raw for i in dict.fromkeys(message.ids) if i in self.notes]
            return [Send(source, Notes(held[i:i + NOTES_PER_MESSAGE])) for i in range(0, len(held), NOTES_PER_MESSAGE)]
        out: list[Output] = []
        for raw in message.notes:
            out += self._ingest(raw, source, now)
        return out

    # --- internals ---

    def _recent(self, author: str, now: float) -> int:
        """Notes held from ``author`` signed in the minute up to ``now`` (the rule for posting here)."""
        return sum(1 for i in self._by_author.get(author, ()) if 0.0 <= now - self.notes[i].note.ts < 60.0)

    def _over_rate(self, author: str, ts: float) -> bool:
        """Whether a note of ``author`` signed at ``ts`` makes some 60 s window hold more than the limit.

        Order-free, so notes arriving out of order are judged alike: a poster that kept to
        :meth:`_recent`'s rule never has more than the limit in any window.
        """
        times = sorted([*(self.notes[i].note.ts for i in self._by_author.get(author, ())), ts])
        for start in times:
            if start <= ts < start + 60.0 and bisect.bisect_left(times, start + 60.0) - \
                    bisect.bisect_left(times, start) > RATE_PER_MINUTE:
                return True
        return False

    def _ingest(self, raw: bytes, source: str | None, now: float) -> list[Output]:
        where = source or self.node_id
        if len(raw) > NOTE_MAX:
            return [Refused(where, "too-large", f"a signed note of {len(raw)} bytes exceeds {NOTE_MAX}")]
        nid = note_id(raw)
        asked = self._wanted.pop(nid, None)
        if nid in self.notes or nid in self._seen:
            if asked is not None and asked[0] == source:
                return []  # we asked two peers for it in a race; this one answered second
            return [Refused(where, "replayed", f"note {nid.hex()[:12]} was delivered before")]
        try:
            signed = decode_signed(raw, what="blackboard note")
            if signed.domain != NOTE_DOMAIN:
                raise DecodeError(f"signed for {signed.domain!r}, not a blackboard note")
            note = decode_struct(signed.body, Note, what="blackboard note")
            if signed.signer != node_public_key(note.author):
                raise DecodeError(f"note claims author {note.author[:8]} but another key signed it")
            verify_bytes(signed.signer, signed.domain, signed.body, signed.sig)
        except MeshllmError as exc:
            return [Refused(where, "forged", f"{type(exc).__name__}: {exc}")]
        refused = self._check(note, now)
        if refused is not None:
            return [Refused(where, refused.code, str(refused), note.author)]
        try:
            owner = self._check_author(note.author, note.membership_proof, note.owner_cert, now)
        except MeshllmError as exc:
            return [Refused(where, "not-member", f"{type(exc).__name__}: {exc}", note.author)]
        if self._over_rate(note.author, note.ts):
            return [Refused(where, "rate", f"{note.author[:8]} signed more than {RATE_PER_MINUTE} notes "
                                           "within a minute", note.author)]
        held = HeldNote(nid, note, bytes(raw), owner)
        self._store(held)
        return [Accepted(held, source), *(Send(p, NoteIds([nid])) for p in sorted(self.connected) if p != source)]

    def _check(self, note: Note, now: float) -> BoardRefusal | None:
        if note.mesh_id != self.mesh_id:
            return BoardRefusal("wrong-mesh", f"note of mesh {note.mesh_id[:12]!r}, not this one")
        if not now - LIFETIME_S <= note.ts <= now + CLOCK_SKEW_S:
            age = (now - note.ts) / 3600
            return BoardRefusal("expired", f"note signed {age:.1f} h ago, beyond the {LIFETIME_S / 3600:.0f} h "
                                           "lifetime" if age > 0 else "note signed in the future")
        error = text_size_error(note.text)
        if error is not None:
            return error
        try:
            node_id_of(node_public_key(note.author))
        except DecodeError as exc:
            return BoardRefusal("forged", str(exc))
        return None

    def _store(self, held: HeldNote) -> None:
        mine = self._by_author.setdefault(held.note.author, [])
        if len(mine) >= PER_AUTHOR_MAX:
            self._drop(min(mine, key=lambda i: self.notes[i].note.ts), remember=True)
        if len(self.notes) >= TOTAL_MAX:
            self._drop(self._order[0][1], remember=True)
        self.notes[held.id] = held
        self._by_author.setdefault(held.note.author, []).append(held.id)
        bisect.insort(self._order, (held.note.ts, held.id))

    def _drop(self, nid: bytes, remember: bool) -> None:
        held = self.notes.pop(nid)
        self._order.remove((held.note.ts, nid))
        mine = self._by_author.get(held.note.author, [])
        mine.remove(nid)
        if not mine:
            self._by_author.pop(held.note.author, None)
        if remember:
            self._seen[nid] = held.note.ts
            while len(self._seen) > SEEN_MAX:
                self._seen.popitem(last=False)
