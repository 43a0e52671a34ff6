"""QUIC transport: one UDP socket per node, mutually authenticated connections, typed streams.

Start at :class:`Endpoint` (``endpoint.py``); ``docs/protocol.md`` ("Transport") describes the
wire protocol. Sans-IO cores: :mod:`.admission`, :mod:`.probes`, :mod:`.backoff`, :mod:`.relay`
(reservations and circuit limits), :mod:`.nat` (reachability, punch schedule), :mod:`.budget`
(room for large frames), :mod:`.limits` (rate buckets, strikes, cool-downs); :mod:`.circuit`
carries a relayed connection's packets in a relay stream (docs/nat.md). The only modules that
touch aioquic's private state are :mod:`.tls` and :mod:`.quic`.
"""

from meshllm.net.backoff import Backoff, dial_with_retry
from meshllm.net.connection import PeerConnection
from meshllm.net.endpoint import Admit, Endpoint, EndpointOptions, StreamHandler
from meshllm.net.errors import (
    AdmissionRefused,
    ConnectError,
    ConnectTimeout,
    NetError,
    NetTimeout,
    PeerMismatch,
    StreamClosed,
)
from meshllm.net.events import PeerEvent, PeerEventKind
from meshllm.net.messages import Addr
from meshllm.net.streams import Stream

__all__ = [
    "Addr",
    "AdmissionRefused",
    "Admit",
    "Backoff",
    "ConnectError",
    "ConnectTimeout",
    "Endpoint",
    "EndpointOptions",
    "NetError",
    "NetTimeout",
    "PeerConnection",
    "PeerEvent",
    "PeerEventKind",
    "PeerMismatch",
    "Stream",
    "StreamClosed",
    "StreamHandler",
    "dial_with_retry",
]
