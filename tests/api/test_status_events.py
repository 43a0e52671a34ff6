"""The ``/api/events`` stream: history, live events, and keep-alives that do not end the subscription."""

from __future__ import annotations

import asyncio

import pytest

from meshllm.api import status
from meshllm.api.events import EventHub


def test_keepalives_keep_the_subscription(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status, "KEEPALIVE_S", 0.05)

    async def main() -> list[str]:
        hub = EventHub()
        hub.publish("before")
        stream = status._sse(hub)
        out = [await anext(stream)]  # history
        out += [await anext(stream), await anext(stream)]  # two quiet periods
        asyncio.get_running_loop().call_later(0.01, hub.publish, "after")
        while "after" not in out[-1]:
            out.append(await anext(stream))
        assert len(hub._queues) == 1, "the subscription survived the keep-alives"
        await stream.aclose()
        assert not hub._queues, "closing the stream ends the subscription"
        return out

    out = asyncio.run(main())
    assert out[0].startswith("event: before") and out[1] == out[2] == ": keepalive\n\n"
    assert out[-1].startswith("event: after")
