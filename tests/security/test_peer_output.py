"""A member that serves a model cannot flood the node that routes to it.

Finding (issue 29): answering routed chats with an endless stream of 64 KiB deltas, a member pushed
346 MiB into the routing node in 60 s (RSS 112 -> 456 MB, 443 MB afterwards); a streaming client
that asked for 50 tokens received 283 MB with status 200. The caller counted neither tokens nor
bytes of a peer's deltas. Now every peer's answer is held to the request's ``max_tokens`` and a
byte budget per token; a peer past it is cut off, struck (three strikes cool it down) and the
request fails over or replays on another node.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from attacker import Answer, Attacker, rss_mb
from nodes import NodeProcess, running_nodes, wait_until
from tinymodels import write_tiny_llama

from meshllm.net import Stream
from meshllm.runtime.tunnel import DeltaFrame, ErrorFrame, RequestFrame

pytestmark = pytest.mark.timeout(120)

MAX_TOKENS = 50


def endless(text: str) -> Answer:
    """Deltas of one token each carrying ``text``, until the caller goes away."""

    async def answer(request: RequestFrame, stream: Stream) -> None:
        while True:
            await stream.send(DeltaFrame(text, (100,)), timeout=5.0)

    return answer


def listed(node: NodeProcess, model: str) -> bool:
    return any(m["id"] == model for m in httpx.get(f"{node.api}/v1/models", timeout=5).json()["data"])


class Mallory:
    """The attacker, run on an event loop in a thread of the test, so the test can talk HTTP meanwhile."""

    def __init__(self, token: str, serves: str, answer: Answer) -> None:
        self.attacker = Attacker(token, serves=(serves,))
        self._answer = answer
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> Attacker:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(15)
        return self.attacker

    async def _start(self) -> None:
        await self.attacker.start()
        self.attacker.answer_requests(self._answer)

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.attacker.stop(), self._loop).result(15)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def stream_tokens(api: str, model: str, limit: int, seconds: float, user: str = "u") -> tuple[int, int, str]:
    """Stream one chat; (content chunks, bytes of content, how it ended), reading at most ``seconds``."""
    chunks = size = 0
    end = "deadline"
    body = {"model": model, "stream": True, "max_tokens": limit, "user": user,
            "messages": [{"role": "user", "content": "hi"}]}
    deadline = time.monotonic() + seconds
    with httpx.stream("POST", f"{api}/v1/chat/completions", json=body, timeout=10) as response:
        if response.status_code != 200:
            return 0, 0, f"status {response.status_code}"
        for line in response.iter_lines():
            if time.monotonic() > deadline:
                break
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                end = "done"
                break
            event = json.loads(line[6:])
            if "error" in event:
                end = f"error {event['error'].get('code')}"
                continue
            content = (event["choices"][0]["delta"].get("content") or "") if event.get("choices") else ""
            if content:
                chunks += 1
                size += len(content.encode())
    return chunks, size, end


def test_endless_small_deltas_stop_at_max_tokens(pair: tuple[NodeProcess, NodeProcess]) -> None:
    a, _ = pair
    with Mallory(a.ready["invite"], "bomb", endless("word ")) as mallory:
        wait_until(lambda: listed(a, "bomb"), 15.0)
        chunks, size, end = stream_tokens(a.api, "bomb", MAX_TOKENS, 10.0)
        print(f"streamed: {chunks} chunks, {size} bytes, ended: {end}; mallory answered {mallory.requests}")
        assert chunks <= MAX_TOKENS, f"the client got {chunks} deltas for max_tokens {MAX_TOKENS}"
        assert end != "deadline", "the stream did not end"


def test_large_deltas_are_cut_off_and_the_peer_cooled(pair: tuple[NodeProcess, NodeProcess]) -> None:
    a, _ = pair
    with Mallory(a.ready["invite"], "bomb", endless("x" * 65536)) as mallory:
        wait_until(lambda: listed(a, "bomb"), 15.0)
        baseline = rss_mb(a.proc.pid)
        statuses = []
        for _ in range(3):
            start = time.monotonic()
            response = httpx.post(f"{a.api}/v1/chat/completions", timeout=15, json={
                "model": "bomb", "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": "hi"}]})
            statuses.append((response.status_code, round(time.monotonic() - start, 2)))
        chunks, size, end = stream_tokens(a.api, "bomb", MAX_TOKENS, 10.0)
        grown = rss_mb(a.proc.pid) - baseline
        print(f"non-streamed: {statuses}; streamed after: {chunks} chunks, {size} bytes, {end}; "
              f"A grew {grown:.1f} MB; mallory answered {mallory.requests}")
        assert all(status in (502, 503) and took < 5.0 for status, took in statuses), statuses
        assert size < MAX_TOKENS * 256
        assert grown < 30, f"A grew by {grown:.0f} MB"
        cooled = a.wait_event(lambda e: e["type"] == "peer_cooled" and e.get("node_id") == mallory.node_id, 10.0)
        assert "request tunnel" in cooled["reason"]


def test_an_overrun_replays_on_an_honest_node(tmp_path: Path) -> None:
    gguf = write_tiny_llama(tmp_path / "tiny.gguf", seed=0)
    with running_nodes() as nodes:
        a = NodeProcess(tmp_path / "a", ["--client"], "a")
        nodes.append(a)
        token = a.wait_ready()["invite"]
        b = NodeProcess(tmp_path / "b", ["--model", str(gguf), "--join", token], "b")
        nodes.append(b)
        b.wait_ready()
        wait_until(lambda: listed(a, "tiny"), 30.0)
        with Mallory(token, "tiny", endless("word ")) as mallory:
            wait_until(lambda: len(a.status()["peers"]) >= 2, 15.0)
            results = []
            for i in range(16):  # users hash to either node: go on until mallory got some
                results.append(stream_tokens(a.api, "tiny", 8, 20.0, user=f"user{i}"))
                if mallory.requests:
                    break
            print(f"results: {results}; mallory answered {mallory.requests}")
            assert mallory.requests >= 1
            assert all(end == "done" and chunks <= 8 for chunks, _size, end in results), results
            a.wait_event(lambda e: e["type"] == "request_replayed" and e.get("from_node_id") == mallory.node_id, 5.0)


MALFORMED = [(0, "x"), (101, "switching"), (999, "x"), (500, "a\r\nb"), (200, "ok")]
"""Error frames no honest peer sends: statuses that are not HTTP errors, a code with a line break."""


def malformed_errors() -> Answer:
    """Answers every request with the next malformed error frame, each twice (plain, then streamed)."""
    frames = itertools.cycle([f for f in MALFORMED for _ in range(2)])

    async def answer(request: RequestFrame, stream: Stream) -> None:
        status, code = next(frames)
        await stream.send(ErrorFrame(status, code, "bad\r\nX-Injected: 1\x00"), timeout=5.0)

    return answer


def test_malformed_error_frames_are_a_clean_error(pair: tuple[NodeProcess, NodeProcess]) -> None:
    a, _ = pair
    with Mallory(a.ready["invite"], "bomb", malformed_errors()):
        wait_until(lambda: listed(a, "bomb"), 15.0)
        for status, code in MALFORMED:
            for stream in (False, True):
                response = httpx.post(f"{a.api}/v1/chat/completions", timeout=15, json={
                    "model": "bomb", "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
                print(f"peer error ({status}, {code!r}), stream={stream}: {response.status_code} {response.text[:160]}")
                assert response.status_code in (502, 503)
                assert response.json()["error"]["type"] == "server_error"
                assert "X-Injected" not in response.headers
