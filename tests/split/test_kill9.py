"""A middle stage killed with -9 (no CONNECTION_CLOSE) fails the in-flight request within 1 s, named."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from split_helpers import MODEL, PROMPT, addr, endpoint

from meshllm.engine.ggml import StageModel
from meshllm.split import Hop, SplitCoordinator, StageFailed, StageServer

HERE = Path(__file__).resolve().parent


def test_kill9_of_a_middle_stage(tiny_model: Path) -> None:
    procs = [
        subprocess.Popen([sys.executable, str(HERE / "stage_proc.py"), str(tiny_model), a, b], stdout=subprocess.PIPE,
                         text=True)
        for a, b in (("2", "4"), ("4", "6"))
    ]
    try:
        peers = [p.stdout.readline().split() for p in procs]  # type: ignore[union-attr]

        async def main() -> tuple[StageFailed, float]:
            ep = await endpoint(probe_interval=0.1)
            ranges = [(2, 4), (4, 6)]
            hops = [Hop(ep.node_id, addr(ep), 0, 2)]
            hops += [Hop(node, f"127.0.0.1:{port}", a, b) for (node, port), (a, b) in zip(peers, ranges, strict=True)]
            server = StageServer(ep)
            coord = SplitCoordinator(server, MODEL, StageModel.load(tiny_model, 0, 2, max_context=256), hops)
            killed_at = 0.0
            try:
                async for _ in coord.generate(PROMPT, max_tokens=200):
                    if not killed_at:
                        os.kill(procs[0].pid, signal.SIGKILL)
                        killed_at = time.monotonic()
            except StageFailed as exc:
                return exc, time.monotonic() - killed_at
            finally:
                server.close()
                await ep.close()
            raise AssertionError("the request survived a killed stage")

        exc, elapsed = asyncio.run(main())
        assert exc.stage_index == 1 and exc.node_id == peers[0][0]
        assert elapsed < 1.0, elapsed
    finally:
        for p in procs:
            p.kill()
            p.wait()
