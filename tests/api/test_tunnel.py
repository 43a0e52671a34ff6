"""Request-tunnel frames and their sans-IO client/server, without sockets."""

from __future__ import annotations

import msgspec
import pytest

from meshllm.api.errors import NoCapacity, UnknownModel, UpstreamError, UpstreamTimeout, error_for
from meshllm.api.tunnel import (
    CallerFrame,
    CancelFrame,
    DeltaFrame,
    RemoteError,
    RequestFrame,
    ServerFrame,
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

CHAT = ChatRequest(model="m", messages=(ChatMessage("system", "s"), ChatMessage("user", "héllo")),
                   params=GenerationParams(max_tokens=5, seed=2**63 - 1, stop=("\n",)),
                   tools=({"type": "function", "function": {"name": "f", "parameters": {}}},), user="u")


def wire(frame: object, type_: object) -> object:
    """What the peer decodes after the frame crossed a stream as msgpack."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(frame), type=type_)


@pytest.mark.parametrize("request_", [CHAT, CompletionRequest(model="m", prompt="p")])
def test_request_and_streamed_response_round_trip(request_: ChatRequest | CompletionRequest) -> None:
    client, server = TunnelClient(), TunnelServer()
    sent = client.start("r1", request_, deadline_ms=30_000)
    server.receive(wire(sent, CallerFrame))  # type: ignore[arg-type]
    assert server.request == RequestFrame(request_id="r1", request=request_, deadline_ms=30_000)
    frames = [server.event(TextDelta("hé")), server.event(TextDelta("llo")),
              server.event(Finish(reason="stop", usage=Usage(7, 2)))]
    events = [client.receive(wire(f, ServerFrame)) for f in frames]  # type: ignore[arg-type]
    assert events == [TextDelta("hé"), TextDelta("llo"), Finish(reason="stop", usage=Usage(7, 2))]
    assert client.done
    client.stream_ended()  # a complete response: closing is fine


def test_server_error_arrives_as_the_same_status() -> None:
    for exc in (UnknownModel("no such model"), PromptTooLong("too long"), NoCapacity("busy")):
        client, server = TunnelClient(), TunnelServer()
        server.receive(client.start("r", CHAT, 1000))
        with pytest.raises(RemoteError) as caught:
            client.receive(wire(server.error(exc), ServerFrame))  # type: ignore[arg-type]
        assert error_for(caught.value)[0] == error_for(exc)[0]
        assert caught.value.code == error_for(exc)[1]["error"]["code"]


def test_failover_only_for_the_peers_fault() -> None:
    assert failover_allowed(NoCapacity("x")) and failover_allowed(UpstreamTimeout("x"))
    assert failover_allowed(UpstreamError("x"))
    assert not failover_allowed(UnknownModel("x")) and not failover_allowed(PromptTooLong("x"))


def test_cancel_frame_and_protocol_violations() -> None:
    client, server = TunnelClient(), TunnelServer()
    server.receive(client.start("r", CHAT, 1000))
    assert client.cancel() == CancelFrame(reason="client disconnected")
    server.receive(CancelFrame())
    assert server.cancelled
    with pytest.raises(DecodeError):
        TunnelServer().receive(CancelFrame())  # must start with a request
    twice = TunnelServer()
    frame = RequestFrame(request_id="a", request=CHAT, deadline_ms=1)
    twice.receive(frame)
    with pytest.raises(DecodeError):
        twice.receive(frame)
    with pytest.raises(DecodeError):
        TunnelServer().receive(RequestFrame(request_id="a", request=CHAT, deadline_ms=1, version=99))


def test_client_rejects_frames_after_the_end_and_early_close() -> None:
    client, server = TunnelClient(), TunnelServer()
    server.receive(client.start("r", CHAT, 1000))
    client.receive(server.event(Finish(reason="length", usage=Usage(1, 1))))
    with pytest.raises(DecodeError):
        client.receive(DeltaFrame("late"))
    cut = TunnelClient()
    cut.start("r", CHAT, 1000)
    cut.receive(DeltaFrame("partial"))
    with pytest.raises(UpstreamError):
        cut.stream_ended()


def test_server_refuses_events_after_the_end() -> None:
    server = TunnelServer()
    server.receive(RequestFrame(request_id="a", request=CHAT, deadline_ms=1))
    server.error(NoCapacity("busy"))
    with pytest.raises(RuntimeError):
        server.event(TextDelta("late"))


def test_garbage_frames_do_not_decode() -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"type": "request", "request_id": 5}), type=CallerFrame)
