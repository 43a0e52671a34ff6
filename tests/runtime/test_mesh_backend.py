"""The mesh backend's stream helpers, on real async generators."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from meshllm.runtime.mesh_backend import _aclose


def test_closing_a_stream_a_cancelled_task_still_reads_leaves_it_to_that_cancellation() -> None:
    """A hedged read cancelled when the client leaves may still be inside the stream when the request's
    cleanup closes it (anyio's cancel scopes cancel the cleanup's wait for it): the close must not raise
    "asynchronous generator is already running", and the stream still ends, its cleanup run."""
    async def main() -> list[str]:
        ended: list[str] = []

        async def events() -> AsyncIterator[int]:
            try:
                await asyncio.Event().wait()
                yield 1
            finally:
                ended.append("cleanup")

        stream = events()
        read = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # the read is inside the stream
        read.cancel()
        await _aclose(stream)
        with pytest.raises(asyncio.CancelledError):
            await read
        await _aclose(stream)  # (closed now: a no-op)
        return ended

    assert asyncio.run(main()) == ["cleanup"]
