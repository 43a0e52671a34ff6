"""Consumption-based stream credit in MeshQuicConnection (sans-IO, in-memory pair)."""

from __future__ import annotations

from aioquic.quic import events
from nacl.signing import SigningKey
from net_helpers import pump, quic_pair

WINDOW = 64 * 1024


def received(conn, stream_id: int) -> int:  # type: ignore[no-untyped-def]
    total = 0
    while (event := conn.next_event()) is not None:
        if isinstance(event, events.StreamDataReceived) and event.stream_id == stream_id:
            total += len(event.data)
    return total


def test_unread_stream_stalls_the_sender_at_the_window() -> None:
    client, server = quic_pair(SigningKey.generate(), SigningKey.generate(), window=WINDOW)
    received(server, 0)
    sid = client.get_next_available_stream_id()
    client.track_stream(sid)
    server.track_stream(sid)
    payload = b"x" * (4 * WINDOW)
    client.send_stream_data(sid, payload)
    now = pump(client, server)
    got = received(server, sid)
    assert got == WINDOW  # nothing consumed: exactly one window crossed
    assert client.unsent_bytes(sid, len(payload)) == len(payload) - WINDOW

    assert server.consume(sid, got)  # the reader caught up: an update is due
    pump(client, server, now)
    got += received(server, sid)
    assert WINDOW < got <= 2 * WINDOW


def test_consumption_below_half_a_window_sends_no_update() -> None:
    client, server = quic_pair(SigningKey.generate(), SigningKey.generate(), window=WINDOW)
    sid = client.get_next_available_stream_id()
    server.track_stream(sid)
    client.send_stream_data(sid, b"y" * 1000)
    pump(client, server)
    assert not server.consume(sid, 1000)
    assert not server.consume(999, 10)  # untracked stream


def test_unsent_bytes_of_unknown_stream_is_zero() -> None:
    client, _server = quic_pair(SigningKey.generate(), SigningKey.generate())
    assert client.unsent_bytes(100, 5) == 0


def test_datagrams_pending_counts_the_unsent_datagram_queue() -> None:
    client, server = quic_pair(SigningKey.generate(), SigningKey.generate())
    assert client.datagrams_pending() == 0
    for _ in range(3):
        client.send_datagram_frame(b"p" * 17)
    assert client.datagrams_pending() == 3
    pump(client, server, rounds=2)
    assert client.datagrams_pending() == 0


def test_a_reply_carries_the_pending_ack() -> None:
    """Writing stream data makes a delayed ACK due now: the reply packet acknowledges the request."""
    client, server = quic_pair(SigningKey.generate(), SigningKey.generate())
    now = pump(client, server)
    sid = client.get_next_available_stream_id()
    client.send_stream_data(sid, b"request")
    for data, _ in client.datagrams_to_send(now=now):
        server.receive_datagram(data, ("10.0.0.1", 1234), now=now)
    assert server.datagrams_to_send(now=now) == []  # ACK still delayed: nothing to send yet
    server.send_stream_data(sid, b"reply")
    replies = server.datagrams_to_send(now=now)
    assert len(replies) == 1  # one packet: the reply with the ACK in it, no separate ACK
    in_flight = client._loss.bytes_in_flight
    for data, _ in replies:
        client.receive_datagram(data, ("10.0.0.2", 4433), now=now)
    assert client._loss.bytes_in_flight < in_flight  # the request was acknowledged by the reply
