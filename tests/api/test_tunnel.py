"""Request-tunnel frames and their sans-IO client/server, without sockets."""

from __future__ import annotations

import pytest

from meshllm.api.errors import NoCapacity, UnknownModel, UpstreamError, UpstreamTimeout, error_for
from meshllm.api.tunnel import (
    CancelFrame,
    RemoteError,
    RequestFrame,
    TunnelClient,
    TunnelServer,
    failover_allowed,
)
from meshllm.engine.base import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    Finish,
    GenerationParams,
    PromptTooLong,
    TextDelta,
    Usage,
)
from meshllm.errors import DecodeError
from meshllm.wire.frames import encode_frame

CHAT = ChatRequest(model="m", messages=(ChatMessage("system", "s"), ChatMessage("user", "héllo")),
                   params=GenerationParams(max_tokens=5, seed=2**63 - 1, stop=("\n",)),
                   tools=({"type": "function", "function": {"name": "f", "parameters": {}}},), user="u")


@pytest.mark.parametrize("request_", [CHAT, CompletionRequest(model="m", prompt="p")])
def test_request_and_streamed_response_round_trip(request_: ChatRequest | CompletionRequest) -> None:
    client, server = TunnelClient(), TunnelServer()
    frames = server.receive(client.start("r1", request_, deadline_ms=30_000))
    assert frames == [RequestFrame(request_id="r1", request=request_, deadline_ms=30_000)]
    assert server.request is not None and server.request.request == request_
    wire = server.event(TextDelta("hé")) + server.event(TextDelta("llo")) + server.event(
        Finish(reason="stop", usage=Usage(7, 2)))
    # bytes may arrive split anywhere
    events = [e for i in range(len(wire)) for e in client.receive(wire[i:i + 1])]
    assert events == [TextDelta("hé"), TextDelta("llo"), Finish(reason="stop", usage=Usage(7, 2))]
    assert client.state == "done"
    client.stream_ended()  # a complete response: closing is fine


def test_server_error_arrives_as_the_same_status() -> None:
    client, server = TunnelClient(), TunnelServer()
    server.receive(client.start("r", CHAT, 1000))
    for exc in (UnknownModel("no such model"), PromptTooLong("too long"), NoCapacity("busy")):
        c2, s2 = TunnelClient(), TunnelServer()
        s2.receive(c2.start("r", CHAT, 1000))
        with pytest.raises(RemoteError) as caught:
            c2.receive(s2.error(exc))
        assert error_for(caught.value)[0] == error_for(exc)[0]
        assert caught.value.code == error_for(exc)[1]["error"]["code"]


def test_failover_only_for_the_peers_fault() -> None:
    assert failover_allowed(NoCapacity("x")) and failover_allowed(UpstreamTimeout("x"))
    assert failover_allowed(UpstreamError("x"))
    assert not failover_allowed(UnknownModel("x")) and not failover_allowed(PromptTooLong("x"))


def test_cancel_frame_and_protocol_violations() -> None:
    client, server = TunnelClient(), TunnelServer()
    server.receive(client.start("r", CHAT, 1000))
    assert server.receive(client.cancel()) == [CancelFrame(reason="client disconnected")]
    assert server.cancelled
    with pytest.raises(DecodeError):
        TunnelServer().receive(encode_frame(CancelFrame()))  # must start with a request
    twice = TunnelServer()
    frame = RequestFrame(request_id="a", request=CHAT, deadline_ms=1)
    with pytest.raises(DecodeError):
        twice.receive(encode_frame(frame) + encode_frame(frame))


def test_client_rejects_frames_after_the_end_and_early_close() -> None:
    client, server = TunnelClient(), TunnelServer()
    server.receive(client.start("r", CHAT, 1000))
    client.receive(server.event(Finish(reason="length", usage=Usage(1, 1))))
    with pytest.raises(DecodeError):
        client.receive(TunnelServer().event(TextDelta("late")))
    cut = TunnelClient()
    cut.start("r", CHAT, 1000)
    cut.receive(TunnelServer().event(TextDelta("partial")))
    with pytest.raises(UpstreamError):
        cut.stream_ended()


def test_garbage_bytes_are_a_decode_error() -> None:
    with pytest.raises(DecodeError):
        TunnelClient().receive(b"\x00\x00\x00\x03abc")
    with pytest.raises(DecodeError):
        TunnelServer().receive(encode_frame({"type": "request", "request_id": 5}))
