"""Route tables for passive clients (sans-IO): built from a member's view, verified and bounded by the client."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sim import MESH, make_key, make_record

from meshllm.errors import BadSignature, DecodeError, MeshllmError, WrongMesh, WrongSigner
from meshllm.identity.ids import node_id as node_id_of
from meshllm.identity.signing import encode_signed, sign
from meshllm.mesh import view
from meshllm.mesh.records import Addresses, Load, Models, RttEntry, ServedModel, sign_record
from meshllm.mesh.routes import (
    BUSY_INTERVAL_S,
    FOLLOW_S,
    HINT_DELAY_S,
    HINT_GAP_S,
    HINT_MAX_BYTES,
    ROUTES_DOMAIN,
    STALE_AFTER_S,
    TABLE_MAX_AGE_S,
    TABLE_MAX_BYTES,
    TABLE_MAX_ENTRIES,
    BadRouteTable,
    ChangeHints,
    PassiveView,
    RouteBook,
    RouteEntry,
    RoutesAsk,
    RoutesChanged,
    RoutesSame,
    RoutesTable,
    RouteTable,
    RouteTableServer,
    TableAccepted,
    TableRefused,
    build_entries,
    open_table,
    quantise_rtt,
    routing_key,
    version_of,
    view_of,
)
from meshllm.mesh.rtt import RTT_FLOOR_MS

ANCHOR = make_key(1)
ANCHOR_ID = node_id_of(bytes(ANCHOR.verify_key))
CLIENT_ID = node_id_of(bytes(make_key(99).verify_key))
NOW = 1_000_000.0


def peer(seed: int, served: list[str] = (), role: str = "host", **fields: object) -> view.PeerEntry:
    rec = make_record(make_key(seed), seq=seed, role=role, name=f"n{seed}",
                      addresses=Addresses(listen=[f"127.0.0.1:{9000 + seed}"]),
                      models=Models(served=[ServedModel(name=m, context=512) for m in served]), **fields)
    return view.PeerEntry(rec, sign_record(make_key(seed), rec), "alive", NOW, NOW)


def anchor_view(*entries: view.PeerEntry) -> tuple[object, dict[str, view.PeerEntry]]:
    own = make_record(ANCHOR, name="anchor", addresses=Addresses(listen=["127.0.0.1:9000"]),
                      rtt={e.record.node_id: RttEntry(3.0, "direct") for e in entries})
    return own, {e.record.node_id: e for e in entries}


def fresh_book() -> RouteBook:
    return RouteBook(CLIENT_ID, MESH, random.Random(0))


def test_table_lists_serving_nodes_first_then_hosts_then_member_clients() -> None:
    own, peers = anchor_view(peer(2, role="client"), peer(3, ["tiny"]), peer(4))
    names = {e.record.node_id: e.record.name for e in peers.values()}
    names[own.node_id] = "anchor"
    entries = build_entries(own, peers)
    assert names[entries[0].node_id] == "n3" and names[entries[-1].node_id] == "n2"
    served = entries[0]
    assert served.models[0].name == "tiny" and served.rtt_ms == quantise_rtt(3.0)


def test_client_accepts_a_table_and_routes_on_it() -> None:
    own, peers = anchor_view(peer(2), peer(3, ["tiny"]))
    server = RouteTableServer(ANCHOR, MESH)
    book = fresh_book()
    reply = server.answer(book.ask(), own, peers, NOW)
    assert isinstance(reply, RoutesTable)
    outcome = book.receive(ANCHOR_ID, reply, NOW)
    assert isinstance(outcome, TableAccepted) and len(outcome.added) == 3
    state = view_of(book, view.empty(CLIENT_ID), NOW)
    members = view.members(state)
    assert {r.name for r in members.values()} == {"anchor", "n2", "n3"}
    tiny = next(r for r in members.values() if r.models.served)
    assert tiny.models.served[0].name == "tiny" and tiny.addresses.listen == ["127.0.0.1:9003"]
    assert members[ANCHOR_ID].rtt[tiny.node_id].rtt_ms == quantise_rtt(3.0)


def test_nothing_changed_costs_a_version_and_jitter_is_no_change() -> None:
    own, peers = anchor_view(peer(3, ["tiny"]))
    server = RouteTableServer(ANCHOR, MESH)
    book = fresh_book()
    book.receive(ANCHOR_ID, server.answer(book.ask(), own, peers, NOW), NOW)
    jittered = msgspec.structs.replace(own, rtt={n: RttEntry(3.05, "direct") for n in own.rtt}, seq=2)
    same = server.answer(book.ask(), jittered, peers, NOW + 1)
    assert same == RoutesSame(book.table.version)
    assert book.receive(ANCHOR_ID, same, NOW + 1) is None and book.confirmed == NOW + 1
    busy = {n: view.PeerEntry(msgspec.structs.replace(e.record, load=Load(in_flight=2)), e.raw, "alive", NOW, NOW)
            for n, e in peers.items()}
    assert isinstance(server.answer(book.ask(), own, busy, NOW + 2), RoutesTable)


def signed_table(entries: list[RouteEntry], *, key=ANCHOR, issued: float = NOW, mesh: str = MESH,
                 version: str | None = None, issuer: str = ANCHOR_ID) -> bytes:
    table = RouteTable(mesh_id=mesh, issuer=issuer, issued=issued,
                       version=version_of(entries) if version is None else version, entries=entries)
    return encode_signed(sign(key, ROUTES_DOMAIN, table))


def entry(seed: int) -> RouteEntry:
    return RouteEntry(node_id=node_id_of(bytes(make_key(seed).verify_key)), listen=[f"127.0.0.1:{seed}"])


@pytest.mark.parametrize(("raw", "error", "words"), [
    (signed_table([entry(2)], key=make_key(7)), WrongSigner, "expected"),
    (signed_table([entry(2)], mesh="other"), WrongMesh, "other"),
    (signed_table([entry(2)], issued=NOW - TABLE_MAX_AGE_S - 1), BadRouteTable, "ago"),
    (signed_table([entry(2)], issued=NOW + 3600), BadRouteTable, "future"),
    (signed_table([entry(2)], version="0" * 32), BadRouteTable, "version"),
    (signed_table([entry(2), entry(2)]), BadRouteTable, "twice"),
    (signed_table([RouteEntry(node_id="not-a-node")]), DecodeError, ""),
    (b"\x93junk", DecodeError, ""),
    (b"x" * (TABLE_MAX_BYTES + 1), BadRouteTable, "cap"),
], ids=["forged-signer", "other-mesh", "stale", "future", "version", "duplicate", "bad-id", "garbage", "oversized"])
def test_bad_tables_are_refused_with_a_reason(raw: bytes, error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words or None):
        open_table(raw, ANCHOR_ID, MESH, NOW)
    book = fresh_book()
    outcome = book.receive(ANCHOR_ID, RoutesTable(raw), NOW)
    assert isinstance(outcome, TableRefused) and outcome.reason and book.table is None


def test_a_tampered_table_fails_its_signature() -> None:
    raw = bytearray(signed_table([entry(2)]))
    raw[-70] ^= 1  # inside the body
    with pytest.raises((BadSignature, DecodeError)):
        open_table(bytes(raw), ANCHOR_ID, MESH, NOW)


def test_too_many_entries_do_not_decode() -> None:
    entries = [entry(i) for i in range(TABLE_MAX_ENTRIES + 1)]
    with pytest.raises(DecodeError):
        open_table(signed_table(entries), ANCHOR_ID, MESH, NOW)


def test_a_replayed_older_table_is_refused_and_changes_nothing() -> None:
    book = fresh_book()
    assert isinstance(book.receive(ANCHOR_ID, RoutesTable(signed_table([entry(2)], issued=NOW)), NOW), TableAccepted)
    old = signed_table([entry(2), entry(3)], issued=NOW - 10)
    outcome = book.receive(ANCHOR_ID, RoutesTable(old), NOW + 1)
    assert isinstance(outcome, TableRefused) and "replay" in outcome.reason
    assert [e.node_id for e in book.entries(NOW + 1)] == [entry(2).node_id]


def test_dropped_nodes_become_tombstones_and_silence_empties_the_view() -> None:
    book = fresh_book()
    book.receive(ANCHOR_ID, RoutesTable(signed_table([entry(2), entry(3)])), NOW)
    state = view_of(book, view.empty(CLIENT_ID), NOW)
    book.receive(ANCHOR_ID, RoutesTable(signed_table([entry(2)], issued=NOW + 1)), NOW + 1)
    after = view_of(book, state, NOW + 1)
    gone = entry(3).node_id
    assert view.diff(state, after) == [view.PeerRemoved(gone, "down")]
    assert after.peers[gone].status == "down"  # known a while: routers answer 503, not 404
    assert (state.peers[gone].changed, after.peers[gone].changed) == (NOW, NOW + 1)  # joined, then left
    assert view_of(book, after, NOW + 2).peers[entry(2).node_id] is after.peers[entry(2).node_id]
    assert view.members(view_of(book, after, NOW + 1 + book.stale_after - 1))  # two pulls may be missed ...
    assert view.members(view_of(book, after, NOW + 1 + book.stale_after + 1)) == {}  # ... not more
    assert book.stale_after >= 2 * book.interval and book.stale_after >= STALE_AFTER_S
    suspect = msgspec.structs.replace(entry(2), status="suspect")
    book.receive(ANCHOR_ID, RoutesTable(signed_table([suspect], issued=NOW + 2)), NOW + 2)
    held = view_of(book, after, NOW + 2).peers[suspect.node_id]
    assert (held.status, held.changed) == ("suspect", NOW)  # a suspicion: still the member it was since NOW


def test_pulls_follow_changes_then_slow_to_the_interval_and_run_on_demand() -> None:
    book = fresh_book()
    assert book.due(0.0)
    gaps = []
    now = 0.0
    for _ in range(8):
        book.pulled(now)
        nxt = book.next_timer()
        gaps.append(nxt - now)
        now = nxt
    assert gaps == [FOLLOW_S, 4.0, 8.0, 16.0, 32.0, book.interval, book.interval, book.interval]
    # a table that adds a member brings the next pull near again
    book.receive(ANCHOR_ID, RoutesTable(signed_table([entry(2)], issued=now)), now)
    assert book.due(now + FOLLOW_S)
    book.pulled(now + FOLLOW_S)
    book.receive(ANCHOR_ID, RoutesTable(signed_table([entry(2)], issued=now + 3)), now + 3)  # same members
    assert not book.due(now + 2 * FOLLOW_S - 0.1) and book.due(now + 2 * FOLLOW_S)  # and it slows again
    # on demand: at once, or 0.5 s after the last demand; never lost, a burst asks once
    now = book.next_timer()
    book.pulled(now)
    assert book.on_demand(now + 1.0) and book.due(now + 1.0)
    book.pulled(now + 1.0)
    assert book.on_demand(now + 1.2) and not book.due(now + 1.2) and book.due(now + 1.5)
    assert not book.on_demand(now + 1.3) and not book.due(now + 1.4)
    # in use: at most BUSY_INTERVAL_S between pulls
    book.pulled(now + 1.5)
    book.busy(now + 2.0)
    assert not book.due(now + 1.5 + BUSY_INTERVAL_S - 0.1) and book.due(now + 1.5 + BUSY_INTERVAL_S)
    book.pulled(now + 10.0)
    book.busy(now + 20.0)  # long since the last pull: at once
    assert book.due(now + 20.0)


def test_passive_view_reads_like_gossip() -> None:
    book = fresh_book()
    book.receive(ANCHOR_ID, RoutesTable(signed_table([entry(2)])), NOW)
    own = make_record(make_key(99))
    pv = PassiveView(own, view.empty(CLIENT_ID))
    events = pv.replace_state(view_of(book, pv.state, NOW))
    assert [type(e).__name__ for e in events] == ["PeerAdded"]
    assert list(pv.members()) == [entry(2).node_id] and pv.connected == set()
    pv.update_own(NOW, name="laptop")
    assert pv.own.name == "laptop" and pv.rtt_matrix() is not None
    assert RoutesAsk(book.table.version).held == book.table.version


def test_rtt_jitter_within_a_factor_four_keeps_the_published_value() -> None:
    assert quantise_rtt(39.0, held=10.0) == 10.0 and quantise_rtt(0.43, held=10.0) == 10.0
    assert quantise_rtt(41.0, held=10.0) == quantise_rtt(41.0) != 10.0
    assert quantise_rtt(0.43) == quantise_rtt(9.9) == RTT_FLOOR_MS  # one busy host's loopback swings alike
    own, peers = anchor_view(peer(3, ["tiny"]))
    server = RouteTableServer(ANCHOR, MESH)
    book = fresh_book()
    book.receive(ANCHOR_ID, server.answer(book.ask(), own, peers, NOW), NOW)
    for ms in (1.6, 11.0, 0.4, 23.7):
        jittered = msgspec.structs.replace(own, rtt={n: RttEntry(ms, "direct") for n in own.rtt})
        assert isinstance(server.answer(book.ask(), jittered, peers, NOW + 1), RoutesSame)
    unmeasured = msgspec.structs.replace(own, rtt={})  # not connected now: the last value stands
    assert isinstance(server.answer(book.ask(), unmeasured, peers, NOW + 1), RoutesSame)
    far = msgspec.structs.replace(own, rtt={n: RttEntry(45.0, "direct") for n in own.rtt})
    assert isinstance(server.answer(book.ask(), far, peers, NOW + 2), RoutesTable)


GOOD = signed_table([entry(2), entry(3)])


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(GOOD)
    for _ in range(draw(st.integers(1, 4))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


@settings(max_examples=2000, deadline=None)
@given(st.one_of(st.binary(max_size=600), mutated()))
def test_table_decoder_fuzz_raises_only_typed_errors(data: bytes) -> None:
    """Random and mutated bytes: a typed refusal, or (a byte the signature does not cover) the very table."""
    try:
        table = open_table(data, ANCHOR_ID, MESH, NOW)
    except MeshllmError:
        return
    assert table == open_table(GOOD, ANCHOR_ID, MESH, NOW)



def test_hints_follow_members_and_models_not_loads() -> None:
    """A member hints its passive clients when a member joins or leaves or changes the models it serves; never
    for a load or a suspicion (they move all the time), and at most once per HINT_GAP_S, a burst coalesced."""
    two, three = peer(2, ["tiny"]), peer(3)
    a, b = two.record.node_id, three.record.node_id
    own, peers = anchor_view(two, three)
    key = routing_key(own, peers)
    busy = msgspec.structs.replace(two.record, load=Load(in_flight=3))
    assert routing_key(own, {**peers, a: view.PeerEntry(busy, b"", "suspect", NOW, NOW)}) == key
    assert routing_key(own, {**peers, peer(4).record.node_id: peer(4)}) != key  # joined
    assert routing_key(own, {a: two}) != key  # left
    assert routing_key(own, {**peers, b: view.PeerEntry(three.record, b"", "down", NOW, NOW)}) != key  # down
    assert routing_key(own, {**peers, b: peer(3, ["tiny"])}) != key  # serves a model now
    loaded = msgspec.structs.replace(own, models=Models(served=[ServedModel(name="big", context=512)]))
    assert routing_key(loaded, peers) != key  # so does the anchor itself

    hints = ChangeHints()
    assert hints.next_check(NOW) == NOW + HINT_DELAY_S
    assert hints.check(key, NOW) and not hints.check(key, NOW + 5)  # the first, then nothing new
    assert hints.next_check(NOW + 0.1) == NOW + HINT_GAP_S  # the next no sooner than the gap
    assert hints.check(routing_key(loaded, peers), NOW + HINT_GAP_S)


def test_a_hint_pulls_unless_the_client_holds_its_version() -> None:
    book = fresh_book()
    table = signed_table([entry(2)], issued=NOW)
    book.receive(ANCHOR_ID, RoutesTable(table), NOW)
    book.pulled(NOW)
    held = book.ask().held
    assert not book.hinted(RoutesChanged(held), NOW + 1) and not book.due(NOW + 1)
    assert book.hinted(RoutesChanged("f" * 32), NOW + 1) and book.due(NOW + 1)
    assert len(msgspec.msgpack.encode(RoutesChanged("f" * 32))) <= HINT_MAX_BYTES
