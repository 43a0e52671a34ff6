"""The blackboard core (sans-IO) under a simulated clock: spreading, every refusal, bounds, expiry, search."""

from __future__ import annotations

import msgspec
import pytest
from sim import MESH, check_member, make_key, proof_for

from meshllm.identity.ids import node_id as node_id_of
from meshllm.identity.signing import sign
from meshllm.mesh.blackboard import (
    LIFETIME_S,
    MESSAGE_BURST,
    PER_AUTHOR_MAX,
    RATE_PER_MINUTE,
    TEXT_MAX,
    Accepted,
    Blackboard,
    BoardMessage,
    BoardRefusal,
    Note,
    Notes,
    NoteWant,
    Query,
    Refused,
    Send,
    parse_words,
    sign_note,
)
from meshllm.mesh.failure import Overstep

T0 = 1_800_000_000.0


def check_author(node: str, proof: bytes, cert: bytes | None, now: float) -> str | None:
    check_member(node, proof, now)
    return "owner-" + node[:4] if cert == b"cert" else None


def board(seed: int) -> tuple[Blackboard, object]:
    key = make_key(seed)
    nid = node_id_of(bytes(key.verify_key))
    return Blackboard(nid, MESH, check_author), key


def note(key: object, text: str, ts: float, **fields: object) -> Note:
    nid = node_id_of(bytes(key.verify_key))  # type: ignore[attr-defined]
    base = {"author": nid, "mesh_id": MESH, "name": "n", "ts": ts, "nonce": bytes(16), "text": text,
            "membership_proof": proof_for(nid)}
    return Note(**{**base, **fields})  # type: ignore[arg-type]


def deliver(to: Blackboard, source: str, raws: list[bytes], now: float) -> list[object]:
    return to.receive(source, Notes(raws), now)


def refusals(out: list[object]) -> list[str]:
    return [o.code for o in out if isinstance(o, Refused)]


def pump(boards: dict[str, Blackboard], out: list[tuple[str, object]], now: float) -> None:
    """Deliver every Send (through the wire codec) until nothing is left."""
    while out:
        src, item = out.pop(0)
        if isinstance(item, Send):
            message = msgspec.msgpack.decode(msgspec.msgpack.encode(item.message), type=BoardMessage)
            out += [(item.to, o) for o in boards[item.to].receive(src, message, now)]


def test_a_note_spreads_over_a_chain_and_reaches_a_late_joiner() -> None:
    (a, ka), (b, _), (c, _) = board(1), board(2), board(3)
    boards = {x.node_id: x for x in (a, b, c)}
    out: list[tuple[str, object]] = []
    out += [(a.node_id, o) for o in a.peer_connected(b.node_id)]
    out += [(b.node_id, o) for o in b.peer_connected(a.node_id)]
    held, sends = a.post(ka, "FINDING: the 270M model fits in 300 MB", "alpha", proof_for(a.node_id), b"cert", T0)
    out += [(a.node_id, o) for o in sends]
    pump(boards, out, T0)
    assert held.id in b.notes and b.notes[held.id].owner == "owner-" + a.node_id[:4]
    # c connects to b only later and learns the note from the ids b sends it
    out += [(b.node_id, o) for o in b.peer_connected(c.node_id)]
    out += [(c.node_id, o) for o in c.peer_connected(b.node_id)]
    pump(boards, out, T0 + 5)
    found = c.search(Query(words=("fits",), kind="FINDING"), T0 + 5)
    assert [h.id for h in found] == [held.id] and found[0].note.author == a.node_id and found[0].kind == "FINDING"
    # honest spreading never makes anyone see a replay
    assert not any(isinstance(o, Refused) for o in out)


def test_forged_replayed_oversized_foreign_and_non_member_notes_are_refused_with_reasons() -> None:
    (a, ka), (b, kb) = board(1), board(2)
    good = sign_note(ka, note(ka, "STATUS: ok", T0))
    assert [type(o) for o in deliver(b, a.node_id, [good], T0)] == [Accepted]
    assert refusals(deliver(b, a.node_id, [good], T0 + 1)) == ["replayed"]
    # signed by b but claiming a as author
    impostor = msgspec.msgpack.encode(sign(kb, "blackboard-note", note(ka, "STATUS: i am a", T0)))
    tampered = bytearray(sign_note(ka, note(ka, "STATUS: original", T0)))
    tampered[tampered.index(b"original")] = ord("O")
    big = sign_note(ka, note(ka, "x" * (TEXT_MAX + 1), T0))
    foreign = sign_note(ka, note(ka, "hi", T0, mesh_id="another"))
    stranger = sign_note(ka, note(ka, "hi", T0, membership_proof=b"nope"))
    out = b.receive(a.node_id, Notes([impostor, bytes(tampered), big, foreign, stranger]), T0)
    refused = [o for o in out if isinstance(o, Refused)]
    assert [r.code for r in refused] == ["forged", "forged", "too-large", "wrong-mesh", "not-member"]
    assert all(r.reason and r.source == a.node_id for r in refused)
    assert "4 KB" in refused[2].reason
    assert len(b.notes) == 1


def test_the_eleventh_note_in_a_minute_is_refused_locally_and_by_receivers() -> None:
    (a, ka), (b, _) = board(1), board(2)
    for i in range(RATE_PER_MINUTE):
        a.post(ka, f"STATUS: step {i}", "alpha", proof_for(a.node_id), None, T0 + i)
    with pytest.raises(BoardRefusal) as refused:
        a.post(ka, "STATUS: one too many", "alpha", proof_for(a.node_id), None, T0 + 30)
    assert refused.value.code == "rate"
    a.post(ka, "STATUS: a minute later", "alpha", proof_for(a.node_id), None, T0 + 61)
    # a peer signing past the limit itself: received in any order, the eleventh is refused
    raws = [sign_note(ka, note(ka, f"spam {i}", T0 + 50 - i * 5)) for i in range(RATE_PER_MINUTE + 1)]
    out = deliver(b, a.node_id, raws, T0 + 60)
    assert refusals(out) == ["rate"] and len(b.notes) == RATE_PER_MINUTE


def test_notes_expire_after_their_lifetime_and_old_ones_are_refused() -> None:
    (a, ka), (b, _) = board(1), board(2)
    raw = sign_note(ka, note(ka, "TIP: use --split", T0))
    deliver(b, a.node_id, [raw], T0)
    b.tick(T0 + LIFETIME_S - 1)
    assert len(b.search(Query(), T0 + LIFETIME_S - 1)) == 1
    b.tick(T0 + LIFETIME_S + 1)
    assert b.notes == {} and b.search(Query(), T0 + LIFETIME_S + 1) == []
    assert refusals(deliver(b, a.node_id, [raw], T0 + LIFETIME_S + 1)) == ["expired"]
    future = sign_note(ka, note(ka, "from the future", T0 + 3600))
    assert refusals(deliver(b, a.node_id, [future], T0)) == ["expired"]


def test_bounds_per_author_and_replays_of_evicted_notes() -> None:
    (a, ka), (b, _) = board(1), board(2)
    raws = [sign_note(ka, note(ka, f"n{i}", T0 + i * 60)) for i in range(PER_AUTHOR_MAX + 1)]
    for i in range(0, len(raws), 32):
        deliver(b, a.node_id, raws[i:i + 32], T0 + PER_AUTHOR_MAX * 60)
    assert len(b.notes) == PER_AUTHOR_MAX
    assert {h.note.text for h in b.notes.values()} == {f"n{i}" for i in range(1, PER_AUTHOR_MAX + 1)}
    assert refusals(deliver(b, a.node_id, [raws[0]], T0 + PER_AUTHOR_MAX * 60 + 1)) == ["replayed"]


def test_a_flooding_peer_is_cut_off_with_oversteps() -> None:
    (a, _), (b, _) = board(1), board(2)
    out = [o for _ in range(100) for o in b.receive(a.node_id, NoteWant([]), T0)]
    assert any(isinstance(o, Overstep) for o in out)


def test_search_by_words_author_time_and_kind() -> None:
    (a, ka), (c, kc), (b, _) = board(1), board(3), board(2)
    deliver(b, a.node_id, [sign_note(ka, note(ka, "QUESTION: who has a GPU?", T0, name="alpha")),
                           sign_note(ka, note(ka, "DONE: bench ran", T0 + 100, name="alpha"))], T0 + 100)
    deliver(b, c.node_id, [sign_note(kc, note(kc, "STATUS: gpu busy", T0 + 200, name="gamma"))], T0 + 200)
    now = T0 + 300
    texts = lambda q: [h.note.text for h in b.search(q, now)]  # noqa: E731
    assert texts(Query()) == ["STATUS: gpu busy", "DONE: bench ran", "QUESTION: who has a GPU?"]
    assert texts(Query(words=("gpu",))) == ["STATUS: gpu busy", "QUESTION: who has a GPU?"]
    assert texts(Query(author="alpha")) == ["DONE: bench ran", "QUESTION: who has a GPU?"]
    assert texts(Query(author=c.node_id[:10])) == ["STATUS: gpu busy"]
    assert texts(Query(since=T0 + 50)) == ["STATUS: gpu busy", "DONE: bench ran"]
    assert texts(Query(kind="question")) == ["QUESTION: who has a GPU?"]
    assert texts(Query(limit=1)) == ["STATUS: gpu busy"]
    assert parse_words("QUESTION: GPU  who") == (("gpu", "who"), "QUESTION")


def test_posting_scrubs_personal_data_and_refuses_empty_or_oversized_text() -> None:
    a, ka = board(1)
    held, _ = a.post(ka, "FINDING: mail jo.smith@example.org, log at /home/jo/run/x.log, key sk-abcdef0123456789abcdef",
                     "alpha", proof_for(a.node_id), None, T0)
    assert held.note.text == "FINDING: mail [email], log at ~/run/x.log, key [secret]"
    for text, code in (("   ", "empty"), ("y" * (TEXT_MAX + 1), "too-large")):
        with pytest.raises(BoardRefusal) as refused:
            a.post(ka, text, "alpha", proof_for(a.node_id), None, T0)
        assert refused.value.code == code


def test_a_late_joiner_catches_up_on_thousands_of_notes_without_a_strike() -> None:
    """2,000 notes come back in 63 messages: more than a peer's message burst, but every one was asked for."""
    (b, _), (c, _) = board(2), board(3)
    now = T0 + PER_AUTHOR_MAX * 60
    for seed in range(10, 20):
        key = make_key(seed)
        raws = [sign_note(key, note(key, f"STATUS: {seed} step {i}", T0 + i * 60)) for i in range(PER_AUTHOR_MAX)]
        for i in range(0, len(raws), 32):
            assert not refusals(deliver(b, node_id_of(bytes(key.verify_key)), raws[i:i + 32], now))
    out = [(b.node_id, o) for o in b.peer_connected(c.node_id)] + [(c.node_id, o) for o in c.peer_connected(b.node_id)]
    seen: list[object] = []
    while out:  # pump, keeping everything the boards said
        src, item = out.pop(0)
        seen.append(item)
        if isinstance(item, Send):
            out += [(item.to, o) for o in boards_by_id({b, c})[item.to].receive(src, item.message, now)]
    assert len(c.notes) == 10 * PER_AUTHOR_MAX and set(c.notes) == set(b.notes)
    assert sum(isinstance(o, Send) and isinstance(o.message, Notes) for o in seen) > MESSAGE_BURST
    assert not [o for o in seen if isinstance(o, Overstep | Refused)]


def boards_by_id(boards: set[Blackboard]) -> dict[str, Blackboard]:
    return {x.node_id: x for x in boards}
