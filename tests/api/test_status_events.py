"""The ``/api/events`` stream: history, live events, and keep-alives that do not end the subscription."""

from __future__ import annotations

import asyncio

import pytest

from meshllm.api import status
from meshllm.events import EventHub


def test_keepalives_keep_the_subscription(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status, "KEEPALIVE_S", 0.05)

    async def main() -> list[str]:
        hub = EventHub()
        hub.publish("mesh_ready")
        stream = status._sse(hub)
        out = [await anext(stream)]  # history
        out += [await anext(stream), await anext(stream)]  # two quiet periods
        asyncio.get_running_loop().call_later(0.01, hub.publish, "ready")
        while "ready" not in out[-1].split("\n")[0]:
            out.append(await anext(stream))
        assert len(hub._queues) == 1, "the subscription survived the keep-alives"
        await stream.aclose()
        assert not hub._queues, "closing the stream ends the subscription"
        return out

    out = asyncio.run(main())
    assert out[0].startswith("event: mesh_ready") and out[1] == out[2] == ": keepalive\n\n"
    assert out[-1].startswith("event: ready")


def test_an_event_published_while_the_history_is_sent_is_streamed() -> None:
    async def main() -> list[str]:
        hub = EventHub()
        hub.publish("mesh_ready")
        stream = status._sse(hub)
        out = [await anext(stream)]  # the history is being sent: the reader has not asked for more yet
        hub.publish("ready")
        out.append(await asyncio.wait_for(anext(stream), 5.0))
        await stream.aclose()
        return out

    out = asyncio.run(main())
    assert out[0].startswith("event: mesh_ready") and out[1].startswith("event: ready")


def test_gossip_heartbeats_are_live_only_and_keep_the_history() -> None:
    async def main() -> tuple[list[str], list[str]]:
        hub = EventHub(history=10)
        subscription = hub.subscribe()
        hub.publish("ready")
        hub.publish("peer_joined", node_id="n1")
        for seq in range(50):  # a minute of a busy mesh's record refreshes
            hub.publish("record_updated", node_id="n1", seq=seq)
        live = [(await asyncio.wait_for(anext(subscription), 5.0)).type for _ in range(52)]
        await subscription.aclose()
        return [e.type for e in hub.recent()], live

    history, live = asyncio.run(main())
    assert history == ["ready", "peer_joined"]
    assert live[:2] == ["ready", "peer_joined"] and live.count("record_updated") == 50
