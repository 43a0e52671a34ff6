"""Our aioquic ``QuicConnection``: tuned configuration, mutual TLS, and receive flow control.

Two behaviours aioquic lacks are added by overriding two of its private methods, here and only
here (``tests/net/test_quic.py`` exercises both against the installed aioquic):

* ``_initialize``: a server connection asks the client for a certificate (see :mod:`.tls`).
* ``_write_stream_limits``: aioquic doubles a stream's receive window whenever the peer has used
  half of it, whether or not the application read anything, so a slow reader buffers without
  bound. We grant credit only for bytes the application has consumed (``consumed + window``),
  which turns QUIC flow control into end-to-end backpressure: a slow reader stalls the writer.
  (:class:`~meshllm.net.streams.Stream` counts a partial frame larger than the window as
  consumed only while the connection has reserved room for the whole frame: see
  :mod:`~meshllm.net.streams`.)
* ``_write_connection_limits``: the same for the connection-wide window (MAX_DATA), which aioquic
  doubles on received bytes: we grant ``received - held + connection window``, where *held* is
  what tracked streams received and the application has not consumed. However many streams a
  peer opens, it can make us hold at most one connection window of unread data.

* ``reset_stream``: aioquic keeps a reset stream's unsent data until the stream is discarded,
  which a peer that never acknowledges can postpone for the life of the connection; the data
  can never be sent again, so we drop it at once.

* ``send_stream_data`` and ``send_datagram_frame``: aioquic writes an ACK only once its 1 ms
  delayed-ACK timer is due, even when it is sending a packet anyway, so a request/response exchange
  (a ping and its answer too) costs an extra ACK-only packet each way (about 100 us of Python per
  side, landing in the middle of the next exchange). When the application writes stream data or a
  datagram we make any pending ACK due now, so it rides in the same packet; pure receivers (bulk
  transfers) keep the delayed ACK.

``unsent_bytes`` reads how much of a stream's written data aioquic has not transmitted yet, which
:class:`~meshllm.net.streams.Stream` uses as its send budget.
"""

from __future__ import annotations

import ssl
from typing import Any

from aioquic.buffer import Buffer
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import MAX_STREAM_DATA_FRAME_CAPACITY, QuicConnection, QuicConnectionState
from aioquic.quic.crypto import (
    INITIAL_CIPHER_SUITE,
    INITIAL_SALT_VERSION_1,
    INITIAL_SALT_VERSION_2,
    CryptoContext,
    CryptoError,
    KeyUnavailableError,
)
from aioquic.quic.packet import QuicFrameType, QuicProtocolVersion, pull_quic_header
from aioquic.tls import Epoch, cipher_suite_hash, hkdf_expand_label, hkdf_extract
from nacl.signing import SigningKey

from meshllm.net import tls
from meshllm.net.errors import AioquicIncompatible

ALPN = "meshllm/2"
"""Protocol version 2: admission grants (issue 18). Nodes of another version fail the handshake."""
MAX_DATAGRAM_SIZE = 1452
"""QUIC packet size: a 1500-byte Ethernet MTU less IPv6 and UDP headers (measured: faster than 1200)."""
CONNECTION_WINDOW = 16 * 1024 * 1024
"""Connection-wide receive window: the most unread data a peer can make us hold over all its streams."""
STREAM_WINDOW = 4 * 1024 * 1024
"""Default per-stream receive window: the most a peer can make us buffer on one unread stream."""
IDLE_TIMEOUT = 20.0
"""Probes find dead peers in about a second; the idle timeout is only the backstop."""
ACCEPT_IDLE_TIMEOUT = 120.0
"""What an acceptor advertises: a dialer that asks for as long (a passive client, whose connection to its
anchor carries a pull a minute and no probes) gets it; everyone else gets :data:`IDLE_TIMEOUT`."""
MAX_DATAGRAM_FRAME = 1200
"""Largest QUIC DATAGRAM frame we accept (probes are a few dozen bytes)."""


def make_configuration(
    signing_key: SigningKey,
    *,
    is_client: bool,
    stream_window: int = STREAM_WINDOW,
    connection_window: int = CONNECTION_WINDOW,
    max_datagram_size: int = MAX_DATAGRAM_SIZE,
    idle_timeout: float = IDLE_TIMEOUT,
) -> QuicConfiguration:
    """A configuration presenting the node's certificate, with CA checks off (we check keys)."""
    config = QuicConfiguration(
        alpn_protocols=[ALPN],
        is_client=is_client,
        idle_timeout=idle_timeout,
        max_data=connection_window,
        max_stream_data=stream_window,
        max_datagram_size=max_datagram_size,
        max_datagram_frame_size=MAX_DATAGRAM_FRAME,
        verify_mode=ssl.CERT_NONE,
    )
    config.certificate = tls.make_certificate(signing_key)
    config.private_key = tls.private_key(signing_key)
    return config


def initial_decrypts(data: bytes, host_cid_length: int) -> bool:
    """Whether a client's Initial packet decrypts, checked without building a connection.

    Initial keys follow from the packet's destination connection id, so anyone can make a valid
    one; but garbage (random bytes under an Initial header) fails here for a fraction of the cost
    of a connection object (see docs/benchmarks.md), and leaves nothing behind.
    """
    buf = Buffer(data=data)
    try:
        header = pull_quic_header(buf, host_cid_length=host_cid_length)
        if header.version is None or header.packet_length > len(data):
            return False
        # Only the client-to-server key (a connection would also derive the other direction's).
        algorithm = cipher_suite_hash(INITIAL_CIPHER_SUITE)
        salt = INITIAL_SALT_VERSION_2 if header.version == QuicProtocolVersion.VERSION_2 else INITIAL_SALT_VERSION_1
        initial = hkdf_extract(algorithm, salt, header.destination_cid)
        crypto = CryptoContext()
        crypto.setup(cipher_suite=INITIAL_CIPHER_SUITE, version=header.version,
                     secret=hkdf_expand_label(algorithm, initial, b"client in", b"", algorithm.digest_size))
        crypto.decrypt_packet(data[:header.packet_length], buf.tell(), 0)
    except (ValueError, CryptoError, KeyUnavailableError):
        return False
    return True


class MeshQuicConnection(QuicConnection):
    """A ``QuicConnection`` with mutual TLS and consumption-based stream and connection credit."""

    def __init__(self, *, configuration: QuicConfiguration, **kwargs: Any) -> None:
        super().__init__(configuration=configuration, **kwargs)
        self._window = configuration.max_stream_data
        self._connection_window = configuration.max_data
        self._consumed: dict[int, int] = {}

    @property
    def stream_window(self) -> int:
        """The per-stream receive window this connection grants."""
        return self._window

    @property
    def started(self) -> bool:
        """True once a packet from the peer decrypted (a server still in its first flight has seen none).

        Initial packets are only obfuscated (their keys follow from the destination connection id),
        so a garbage one fails to decrypt and leaves the connection in its first flight: the
        endpoint then drops it instead of holding a handshake slot for it.
        """
        state = getattr(self, "_state", None)
        if state is None:
            raise AioquicIncompatible("aioquic's QuicConnection has no _state")
        return state is not QuicConnectionState.FIRSTFLIGHT

    @property
    def closed_by_peer(self) -> tuple[int, str] | None:
        """The peer's CONNECTION_CLOSE (error code, reason), as soon as it arrived; None before.

        aioquic reports a close only when the draining period after it ends (3 PTOs, RFC 9000 10.2),
        and under load a PTO grows to tens of seconds: a connection the peer had closed (rotated out
        of its partial view, cooled down) went on looking open here for up to two minutes, and our
        failure detector, probing into it, declared the live peer down (docs/benchmarks.md, tenth pass).
        """
        state = getattr(self, "_state", None)
        if state is None:
            raise AioquicIncompatible("aioquic's QuicConnection has no _state")
        event = getattr(self, "_close_event", None)
        if state is not QuicConnectionState.DRAINING or event is None:
            return None
        return event.error_code, event.reason_phrase

    # -- flow control -------------------------------------------------------------------------

    def track_stream(self, stream_id: int) -> None:
        """Start granting credit on ``stream_id`` only as its data is consumed."""
        self._consumed.setdefault(stream_id, 0)

    def forget_stream(self, stream_id: int) -> None:
        """Stop tracking a finished stream."""
        self._consumed.pop(stream_id, None)

    def consume(self, stream_id: int, consumed: int) -> bool:
        """Record that the application has consumed ``consumed`` bytes of the stream in total.

        Returns True when a window update is now due (the caller should transmit).
        """
        if stream_id not in self._consumed:
            return False
        self._consumed[stream_id] = consumed
        stream = self._stream(stream_id)
        return stream is not None and consumed + self._window - stream.max_stream_data_local >= self._window // 2

    def held_bytes(self) -> int:
        """Bytes the peer sent on tracked streams that the application has not consumed yet."""
        held = 0
        for stream_id, consumed in self._consumed.items():
            stream = self._stream(stream_id)
            if stream is not None:
                held += max(0, stream.receiver.highest_offset - consumed)
        return held

    def datagrams_pending(self) -> int:
        """DATAGRAM frames queued and not yet sent (aioquic's queue is unbounded)."""
        pending = getattr(self, "_datagrams_pending", None)
        if pending is None:
            raise AioquicIncompatible("aioquic's QuicConnection has no _datagrams_pending queue")
        return len(pending)

    def credit_blocked(self, stream_id: int) -> bool:
        """Whether the stream's unsent data waits for the *peer's* credit (stream or connection):
        the peer is not reading. Otherwise it waits for congestion control (the network)."""
        stream = self._stream(stream_id)
        if stream is None:
            return False
        if stream.sender.highest_offset >= stream.max_stream_data_remote:
            return True
        return bool(getattr(self, "_remote_max_data_used", 0) >= getattr(self, "_remote_max_data", 1))

    def unsent_bytes(self, stream_id: int, written: int) -> int:
        """How many of the ``written`` bytes aioquic has not put on the wire yet."""
        stream = self._stream(stream_id)
        if stream is None:
            return 0
        return max(0, written - stream.sender.highest_offset)

    def send_stream_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        super().send_stream_data(stream_id, data, end_stream)
        self.piggyback_ack()

    def send_datagram_frame(self, data: bytes) -> None:
        super().send_datagram_frame(data)
        self.piggyback_ack()

    def reset_stream(self, stream_id: int, error_code: int) -> None:
        super().reset_stream(stream_id, error_code)
        self.drop_unsent(stream_id)

    def drop_unsent(self, stream_id: int) -> None:
        """Free a reset stream's send buffer (by us, or by aioquic on the peer's STOP_SENDING)."""
        stream = self._stream(stream_id)
        if stream is not None and getattr(stream.sender, "_reset_error_code", None) is not None:
            stream.sender._buffer = bytearray()  # aioquic never sends or resends after a reset

    def smoothed_rtt_ms(self) -> float | None:
        """QUIC's own smoothed RTT (RFC 9002: from the ACKs of everything we sent, the handshake included),
        in milliseconds; None before the first sample."""
        loss = self._recovery()
        return loss._rtt_smoothed * 1000.0 if loss._rtt_initialized else None

    def min_rtt_ms(self) -> float | None:
        """The smallest RTT QUIC has measured on this connection (RFC 9002's min_rtt), in milliseconds: the
        path's round trip with no queueing or scheduling delay in it. None before the first sample."""
        loss = self._recovery()
        return loss._rtt_min * 1000.0 if loss._rtt_initialized else None

    def _recovery(self) -> Any:
        """aioquic's loss recovery state, which holds the RTT estimates."""
        loss = getattr(self, "_loss", None)
        if loss is None or not all(hasattr(loss, a) for a in ("_rtt_initialized", "_rtt_smoothed", "_rtt_min")):
            raise AioquicIncompatible("aioquic's QuicConnection has no _loss with RTT estimates")
        return loss

    def piggyback_ack(self) -> None:
        """Make a pending (delayed) 1-RTT ACK due now, so the next packet we send carries it."""
        spaces = getattr(self, "_spaces", None)
        if spaces is None:
            raise AioquicIncompatible("aioquic's QuicConnection has no _spaces table")
        space = spaces.get(Epoch.ONE_RTT)
        if space is not None and getattr(space, "ack_at", None) is not None:
            space.ack_at = 0.0

    def _stream(self, stream_id: int) -> Any:
        streams = getattr(self, "_streams", None)
        if streams is None:
            raise AioquicIncompatible("aioquic's QuicConnection has no _streams table")
        return streams.get(stream_id)

    # -- private aioquic hooks ----------------------------------------------------------------

    def _initialize(self, peer_cid: bytes) -> None:
        super()._initialize(peer_cid)
        if not self.configuration.is_client:
            tls.request_client_certificate(self.tls)

    def _write_connection_limits(self, builder: Any, space: Any) -> None:
        limit = getattr(self, "_local_max_data", None)
        if limit is None:
            raise AioquicIncompatible("aioquic's QuicConnection has no _local_max_data")
        target = limit.used - self.held_bytes() + self._connection_window
        if target - limit.value >= self._connection_window // 2:
            limit.value = target
        used, limit.used = limit.used, 0  # aioquic doubles on received bytes when used * 2 > value
        try:
            super()._write_connection_limits(builder, space)
        finally:
            limit.used = used

    def _write_stream_limits(self, builder: Any, space: Any, stream: Any) -> None:
        consumed = self._consumed.get(stream.stream_id)
        if consumed is None:
            return
        target = consumed + self._window
        if target - stream.max_stream_data_local >= self._window // 2:
            stream.max_stream_data_local = target
        if stream.max_stream_data_local_sent != stream.max_stream_data_local:
            buf = builder.start_frame(
                QuicFrameType.MAX_STREAM_DATA,
                capacity=MAX_STREAM_DATA_FRAME_CAPACITY,
                handler=self._on_max_stream_data_delivery,
                handler_args=(stream,),
            )
            buf.push_uint_var(stream.stream_id)
            buf.push_uint_var(stream.max_stream_data_local)
            stream.max_stream_data_local_sent = stream.max_stream_data_local
