"""Coordinator: the first stage of a chain and the sampling loop of a split request.

It embeds the prompt and runs its own layers (in a worker thread), sends the activations down the
chain in :class:`Prefill` chunks and then one :class:`Decode` per token, and waits for each
:class:`Tokens` from the last stage, yielding token ids as they come. Every wait has a deadline
(decode: ``decode_timeout``; prefill: that plus ``prefill_s_per_token`` per token) and ends early
on anything that proves a stage dead: an Error relayed up the chain, the transport reporting a
chain node suspect or closed (the coordinator connects to every stage so its probes watch them
all). A missed deadline is attributed by pinging every stage with the session: the first stage
that does not answer, or has not reached the expected position, is the one named in
:class:`StageFailed`. Stop travels down the chain when the request ends, however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from meshllm.engine.ggml import StageModel
from meshllm.errors import DecodeError
from meshllm.net import NetError, PeerEvent, PeerEventKind
from meshllm.split import codec
from meshllm.split.errors import StageFailed
from meshllm.split.frames import Decode, Error, Hop, Open, Prefill, Sampling, Stop, Tokens
from meshllm.split.lanes import PROBE_TIMEOUT, Lane
from meshllm.split.stage import StageServer
from meshllm.wire.addr import parse_addr


@dataclass(frozen=True)
class SplitToken:
    """One generated token of a split request."""

    token_id: int
    finish: str | None
    """``"stop"`` (a stop id was sampled) or ``"length"`` (context or ``max_tokens`` reached) on the last one."""


@dataclass(frozen=True)
class Deadlines:
    """Per-hop deadlines of a split request."""

    decode_timeout: float = 1.0
    """Seconds for one token to go around the chain."""
    prefill_s_per_token: float = 0.05
    """Extra seconds allowed per prompt token in a prefill chunk."""
    prefill_chunk: int = 256
    """Prompt tokens per Prefill frame (bounds frame size and per-hop latency)."""
    connect_timeout: float = 1.0
    soft_factor: float = 8.0
    """A decode step slower than this many times the recent average triggers a liveness check."""
    soft_min: float = 0.2
    """Floor of that check's delay in seconds (scheduling noise must not cause pings every token)."""


class SplitCoordinator:
    """Runs split requests for one model whose first layers (``first``) this node holds.

    ``chain`` is the plan as hops, ``chain[0]`` being this node. ``on_stage_failed`` is told about
    every :class:`StageFailed` so the node can mark the node suspect and replan.
    """

    def __init__(
        self,
        server: StageServer,
        model: str,
        first: StageModel,
        chain: Sequence[Hop],
        *,
        deadlines: Deadlines | None = None,
        on_stage_failed: Callable[[StageFailed], None] | None = None,
    ) -> None:
        if len(chain) < 2 or chain[0].node_id != server.endpoint.node_id:
            raise ValueError("a split chain has at least two stages and starts at this node")
        if (first.layer_start, first.layer_end) != (chain[0].layer_start, chain[0].layer_end):
            raise ValueError("the first stage's layers differ from the chain's first hop")
        self.server = server
        self.model = model
        self.first = first
        self.chain = list(chain)
        self.deadlines = deadlines or Deadlines()
        self.on_stage_failed = on_stage_failed
        self._compute = server.compute
        self.step_s = 0.0
        """Recent decode step time (exponential average): sets how soon a silent chain is checked."""

    async def generate(
        self,
        prompt: Sequence[int],
        *,
        max_tokens: int,
        sampling: Sampling | None = None,
        dtype: codec.Dtype = "f32",
        session: str | None = None,
    ) -> AsyncIterator[SplitToken]:
        """Stream the tokens generated after ``prompt``; raises :class:`StageFailed` naming a failed stage."""
        run = _Run(self, session or uuid.uuid4().hex, dtype)
        try:
            await run.start(list(prompt), sampling or Sampling())
            token = await run.prefill(list(prompt))
            for n in range(1, max_tokens + 1):
                finish = token.finish or ("length" if n == max_tokens else None)
                yield SplitToken(token.token_ids[0], finish)
                if finish:
                    return
                token = await run.decode(token.token_ids[0], token.pos)
        except StageFailed as exc:
            if self.on_stage_failed is not None:
                self.on_stage_failed(exc)
            raise
        finally:
            await run.finish()


class _Run:
    """One request's state: its session, lanes, reply queue and failure watch."""

    def __init__(self, coord: SplitCoordinator, session: str, dtype: codec.Dtype) -> None:
        self.c = coord
        self.session = session
        self.dtype = dtype
        self.lane: Lane | None = None
        self.replies: asyncio.Queue[Tokens | Error | StageFailed] = asyncio.Queue()
        self._index = {hop.node_id: i for i, hop in enumerate(coord.chain)}
        self._cleanup: list[Callable[[], object]] = []

    async def start(self, prompt: list[int], sampling: Sampling) -> None:
        c, server = self.c, self.c.server
        self._cleanup.append(server.route_replies(self.session, self._reply))
        self._cleanup.append(server.endpoint.on_peer_event(self._peer_event))
        await asyncio.gather(*(self._connect(i) for i in range(1, len(c.chain))))
        hop = c.chain[1]
        try:
            self.lane = await server.pool.get(hop.node_id, hop.addr)
            penalties = sampling.repeat_penalty != 1.0 or sampling.presence_penalty or sampling.frequency_penalty
            await self.lane.send(Open(
                session=self.session, model=c.model, layer_start=hop.layer_start, layer_end=hop.layer_end,
                dtype=self.dtype, chain=c.chain, index=1, sampling=sampling,
                history=prompt if penalties else [], max_context=c.first.max_context,
            ))
        except NetError as exc:
            raise StageFailed(1, hop.node_id, f"lane unreachable: {exc}") from None

    async def prefill(self, prompt: list[int]) -> Tokens:
        d = self.c.deadlines
        for pos in range(0, len(prompt), d.prefill_chunk):
            ids = prompt[pos : pos + d.prefill_chunk]
            x = await self._run_first(ids, pos)
            last = pos + len(ids) >= len(prompt)
            await self._send(Prefill(
                session=self.session, pos=pos, n_tokens=len(ids), dtype=self.dtype, shape=x.shape,
                activations=codec.encode(x, self.dtype), sample=last,
            ))
        return await self._await(len(prompt), d.decode_timeout + d.prefill_s_per_token * len(prompt))

    async def decode(self, token: int, pos: int) -> Tokens:
        loop = asyncio.get_running_loop()
        started = loop.time()
        x = await self._run_first([token], pos)
        await self._send(Decode(
            session=self.session, pos=pos, n_tokens=1, dtype=self.dtype, shape=x.shape,
            activations=codec.encode(x, self.dtype),
        ))
        d, c = self.c.deadlines, self.c
        check = max(d.soft_min, d.soft_factor * c.step_s) if c.step_s else d.decode_timeout
        reply = await self._await(pos + 1, d.decode_timeout, check_after=check)
        took = loop.time() - started
        c.step_s = took if not c.step_s else 0.8 * c.step_s + 0.2 * took
        return reply

    async def finish(self) -> None:
        for undo in self._cleanup:
            undo()
        self.c.first.reset(self.session)
        if self.lane is not None and self.lane.closed is None:
            with contextlib.suppress(NetError):
                await self.lane.send(Stop(session=self.session))

    # -- internals ---------------------------------------------------------------------------

    async def _connect(self, index: int) -> None:
        hop = self.c.chain[index]
        try:
            await self.c.server.endpoint.connect(
                parse_addr(hop.addr), hop.node_id, timeout=self.c.deadlines.connect_timeout
            )
        except (NetError, OSError, DecodeError) as exc:
            raise StageFailed(index, hop.node_id, f"unreachable: {exc}") from None

    async def _run_first(self, ids: list[int], pos: int) -> np.ndarray:
        tokens = np.asarray(ids, dtype=np.int64)
        first = self.c.first
        return await self.c._compute.run("first", len(ids) == 1, lambda: first.forward(self.session, tokens, pos))

    async def _send(self, frame: Prefill | Decode) -> None:
        assert self.lane is not None
        try:
            await self.lane.send(frame)
        except NetError as exc:
            raise StageFailed(1, self.c.chain[1].node_id, f"lane lost: {exc}") from None

    async def _await(self, pos: int, timeout: float, check_after: float | None = None) -> Tokens:
        """The Tokens for ``pos``; fails a stage that does not answer a Ping once ``check_after`` has passed.

        The early check only fails a stage that is silent (dead or cut off): a slow but answering
        chain gets the whole ``timeout``, so load spikes do not cost requests.
        """
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        check = loop.time() + check_after if check_after is not None and check_after < timeout else None
        while True:
            wait_until = check if check is not None else end
            try:
                item = await asyncio.wait_for(self.replies.get(), max(0.0, wait_until - loop.time()))
            except TimeoutError:
                if check is not None:
                    check = None
                    pongs = await asyncio.gather(*(self._ping(i) for i in range(1, len(self.c.chain))))
                    silent = next((i for i, pong in enumerate(pongs, start=1) if pong is None), None)
                    if silent is not None and self.replies.empty():
                        node = self.c.chain[silent].node_id
                        raise StageFailed(silent, node, f"no answer to a ping after {check_after:.2f}s") from None
                    continue
                raise await self._diagnose(pos, timeout) from None
            if isinstance(item, StageFailed):
                raise item
            if isinstance(item, Error):
                stage = min(max(item.stage, 0), len(self.c.chain) - 1)
                raise StageFailed(stage, self.c.chain[stage].node_id, f"{item.code}: {item.message}")
            if item.pos == pos:
                return item

    def _reply(self, peer_id: str, frame: Tokens | Error) -> None:
        """Reply sink: Tokens count only from the last stage; Errors from any chain node."""
        last = self.c.chain[-1].node_id
        if (isinstance(frame, Tokens) and peer_id == last) or (isinstance(frame, Error) and peer_id in self._index):
            self.replies.put_nowait(frame)

    def _peer_event(self, event: PeerEvent) -> None:
        index = self._index.get(event.node_id)
        if index and event.kind in (PeerEventKind.SUSPECT, PeerEventKind.CLOSED):
            why = f"connection {event.kind.value}" + (f": {event.reason}" if event.reason else "")
            self.replies.put_nowait(StageFailed(index, event.node_id, why))

    async def _diagnose(self, pos: int, timeout: float) -> StageFailed:
        """Name the stage behind a missed deadline: the first that is silent or behind ``pos``."""
        pongs = await asyncio.gather(*(self._ping(i) for i in range(1, len(self.c.chain))))
        for index, pong in enumerate(pongs, start=1):
            node = self.c.chain[index].node_id
            if pong is None:
                return StageFailed(index, node, f"no answer after a {timeout:.2f}s deadline")
            if pong < pos:
                return StageFailed(index, node, f"stalled at position {pong} of {pos} after {timeout:.2f}s")
        last = len(self.c.chain) - 1
        return StageFailed(last, self.c.chain[last].node_id, f"no tokens within {timeout:.2f}s")

    async def _ping(self, index: int) -> int | None:
        hop = self.c.chain[index]
        try:
            lane = await asyncio.wait_for(self.c.server.pool.get(hop.node_id, hop.addr), PROBE_TIMEOUT)
            pong = await lane.probe(PROBE_TIMEOUT, session=self.session)
        except (NetError, TimeoutError):
            return None
        return None if pong is None else pong.pos
