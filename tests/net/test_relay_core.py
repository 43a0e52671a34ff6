"""Sans-IO cores of NAT traversal: relay reservations and limits, reachability, punch schedule."""

from __future__ import annotations

from meshllm.net.nat import PunchSchedule, Reachability, reachability, serves_relay, sync_delay
from meshllm.net.relay import Circuit, Refused, RelayBook, RelayLimits, Reserved


def test_reservations_expire_and_are_capped() -> None:
    book = RelayBook(RelayLimits(max_reservations=1, reservation_ttl_s=10.0))
    assert isinstance(book.reserve("a", 0.0), Reserved)
    assert isinstance(book.reserve("b", 1.0), Refused)  # full
    assert isinstance(book.reserve("a", 5.0), Reserved)  # a refresh is always granted
    book.expire(15.1)
    assert book.reservations == {}
    assert isinstance(book.reserve("b", 16.0), Reserved)


def test_circuits_need_a_reservation_and_respect_per_peer_limits() -> None:
    book = RelayBook(RelayLimits(circuits_per_peer=1))
    assert isinstance(book.open("a", "b", 0.0), Refused)
    book.reserve("b", 0.0)
    assert isinstance(book.open("b", "b", 0.0), Refused)
    first = book.open("a", "b", 0.0)
    assert isinstance(first, Circuit)
    assert isinstance(book.open("c", "b", 0.0), Refused)  # b already takes part in one
    book.close(first.id)
    assert isinstance(book.open("c", "b", 0.0), Circuit)


def test_circuit_byte_and_time_limits() -> None:
    book = RelayBook(RelayLimits(circuit_bytes=100, circuit_seconds=10.0))
    book.reserve("b", 0.0)
    circuit = book.open("a", "b", 0.0)
    assert isinstance(circuit, Circuit)
    assert book.carry(circuit.id, 60, 1.0) is None
    assert "bytes" in (book.carry(circuit.id, 60, 1.0) or "")
    other = book.open("a", "b", 0.0)
    assert isinstance(other, Circuit)
    assert "s" in (book.carry(other.id, 1, 11.0) or "")
    book.release("b")
    assert "b" not in book.reservations


def test_reachability_from_observed_addresses() -> None:
    local = {"10.0.1.2"}.__contains__
    assert reachability(9338, [], local) is Reachability.UNKNOWN
    assert reachability(9338, [("10.0.1.2", 9338)], local) is Reachability.PUBLIC
    assert reachability(9338, [("198.18.0.11", 9338)], local) is Reachability.PRIVATE
    assert reachability(9338, [("10.0.1.2", 40000)], local) is Reachability.PRIVATE  # port rewritten
    assert reachability(9338, [("relay:ab:1", 0)], local) is Reachability.UNKNOWN  # relayed views don't count
    assert reachability(9338, [("198.18.0.11", 9338)], local, announced=True) is Reachability.PUBLIC
    assert serves_relay("auto", Reachability.PUBLIC) and not serves_relay("auto", Reachability.PRIVATE)
    assert serves_relay("on", Reachability.PRIVATE) and not serves_relay("off", Reachability.PUBLIC)
    assert sync_delay(0.04) == 0.02


def test_punch_schedule_backs_off_and_forgets() -> None:
    schedule = PunchSchedule(initial=1.0, maximum=4.0)
    assert schedule.next_in("b", 0.0) is None  # not relayed: nothing scheduled
    assert schedule.due(["b"], 0.0) == ["b"]
    schedule.started("b")
    assert schedule.due(["b"], 0.0) == [] and schedule.next_in("b", 0.0) == 0.0  # running
    schedule.finished("b", False, 0.0)
    assert schedule.due(["b"], 0.1) == []
    assert 0.75 - 0.1 <= schedule.next_in("b", 0.1) <= 1.0 - 0.1  # type: ignore[operator]
    waits = []
    for now in (1.0, 10.0, 100.0, 1000.0):
        assert schedule.due(["b"], now) == ["b"]
        schedule.started("b")
        schedule.finished("b", False, now)
        waits.append(schedule.peers["b"].not_before - now)
    assert all(0.5 <= w <= 4.0 for w in waits) and waits[-1] > waits[0]
    schedule.due([], 2000.0)
    assert "b" not in schedule.peers  # no longer relayed
    schedule.started("c")
    schedule.finished("c", True, 0.0)
    assert "c" not in schedule.peers
