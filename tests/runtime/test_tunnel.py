"""Request-tunnel frames and their sans-IO client/server, without sockets."""

from __future__ import annotations

import msgspec
import pytest

from meshllm.engine.base import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    Embeddings,
    EmbedRequest,
    Finish,
    GenerationParams,
    PromptTooLong,
    TextDelta,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Unsupported,
    Usage,
)
from meshllm.errors import DecodeError
from meshllm.runtime.errors import NoCapacity, UnknownModel, UpstreamError, UpstreamTimeout, error_for
from meshllm.runtime.tunnel import (
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

CHAT = ChatRequest(model="m", messages=(ChatMessage("system", "s"), ChatMessage("user", "héllo"),
                                        ChatMessage("assistant", "", tool_calls=(ToolCall("c1", "f", "{}"),)),
                                        ChatMessage("tool", "42", name="f", tool_call_id="c1")),
                   params=GenerationParams(max_tokens=5, seed=2**63 - 1, stop=("\n",), grammar='root ::= "x"',
                                           logprobs=2),
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


def test_token_ids_logprobs_cached_tokens_and_stop_sequence_cross_the_tunnel() -> None:
    client, server = TunnelClient(), TunnelServer()
    server.receive(wire(client.start("r", CompletionRequest(model="m", prompt=(1, 2, 3)), 1000), CallerFrame))  # type: ignore
    assert server.request is not None and server.request.request.prompt == (1, 2, 3)  # type: ignore[union-attr]
    delta = TextDelta("é", tokens=(7, 8), logprobs=(TokenLogprob(7, b"\xc3", -0.5, (TopLogprob(9, b"a", -1.0),)),
                                                    TokenLogprob(8, b"\xa9", -0.25)))
    finish = Finish(reason="stop", usage=Usage(3, 2, cached_tokens=2), stop_sequence="\n")
    assert [client.receive(wire(server.event(e), ServerFrame)) for e in (delta, finish)] == [delta, finish]  # type: ignore


def test_embeddings_cross_the_tunnel() -> None:
    client, server = TunnelClient(), TunnelServer()
    request = EmbedRequest(model="m", inputs=("a", (1, 2)), user="u")
    server.receive(wire(client.start("r", request, 1000), CallerFrame))  # type: ignore[arg-type]
    assert server.request is not None and server.request.request == request
    answer = Embeddings(vectors=(b"\x00" * 8, b"\x01" * 8), prompt_tokens=4)
    assert client.receive(wire(server.event(answer), ServerFrame)) == answer  # type: ignore[arg-type]
    assert client.done


def test_the_field_an_error_names_crosses_the_tunnel() -> None:
    client, server = TunnelClient(), TunnelServer()
    server.receive(client.start("r", CHAT, 1000))
    with pytest.raises(RemoteError) as caught:
        client.receive(wire(server.error(Unsupported("no grammars here", param="response_format")), ServerFrame))  # type: ignore
    status, body = error_for(caught.value)
    assert (status, body["error"]["code"], body["error"]["param"]) == (400, "unsupported_parameter", "response_format")


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
