"""Stage control and lanes answer only the chain's own coordinator (issue 18, "any member can tear down or
probe another member's split").

A real coordinator and a real ``--worker`` (subprocesses through the CLI) serve a 2-stage split of a tiny
model. The attacker is a member of the same mesh (it joined with the coordinator's invite, as any member
may) that crafts stage-control and stage-lane traffic with the project's own modules. Findings
reproduced (each failed on the original main):

- ``Release{model}`` from a member that is not the chain's coordinator released the worker's stage, and
  the coordinator's completions turned into 503s;
- ``Host{path=...}`` made the worker report whether any path exists on its disk, and its sha256;
- a member outside the plan could ``Open`` its own session on the worker's stage (a forged chain with
  itself as coordinator) and have the worker compute for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from nacl.signing import SigningKey

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nodes import NodeProcess, running_nodes
from tinymodels import write_tiny_llama

from meshllm.mesh.membership import join_mesh
from meshllm.net import Endpoint, NetError
from meshllm.split import codec
from meshllm.split.frames import KIND as LANE
from meshllm.split.frames import LANE_FRAME_MAX, Hop, Open, Prefill
from meshllm.wire.addr import parse_addr

pytestmark = pytest.mark.timeout(180)
CONTROL = "stage-control"
MODEL = "tiny"


class Mesh:
    """The coordinator, its worker and the chain they formed."""

    def __init__(self, coord: NodeProcess, worker: NodeProcess, gguf: Path, chain: list[dict[str, Any]]) -> None:
        self.coord, self.worker, self.gguf, self.chain = coord, worker, gguf, chain

    @property
    def worker_range(self) -> tuple[int, int]:
        (stage,) = [s for s in self.chain if s["node_id"] == self.worker.node_id]
        return stage["layers"][0], stage["layers"][1]

    def completion(self) -> httpx.Response:
        return httpx.post(self.coord.api + "/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "Hello", "max_tokens": 6, "temperature": 0})


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    tmp = tmp_path_factory.mktemp("stage-control")
    gguf = write_tiny_llama(tmp / "tiny.gguf", n_layers=4, seed=11)
    with running_nodes() as nodes:
        coord = NodeProcess(tmp / "c", ["--model", str(gguf), "--split", "force", "--stages", "2"], "coord")
        nodes.append(coord)
        token = coord.wait_ready()["invite"]
        worker = NodeProcess(tmp / "w", ["--worker", "--join", token], "w")
        nodes.append(worker)
        worker.wait_ready()
        ready = coord.wait_event(lambda e: e["type"] == "split_ready", 90.0)
        assert len(ready["stages"]) == 2
        (split,) = coord.status()["splits"]
        m = Mesh(coord, worker, gguf, split["stages"])
        first = m.completion()
        assert first.status_code == 200, first.text
        yield m


def attacker_run(mesh: Mesh, job: Any) -> Any:
    """Run ``job(endpoint, conn_to_worker)`` as a fresh member of the mesh (joined with the invite)."""

    async def main() -> Any:
        key = SigningKey.generate()
        membership = join_mesh(key, mesh.coord.ready["invite"], time.time())
        ep = await Endpoint.create(key, "127.0.0.1", 0, admit=lambda *_: None, local_proof=lambda: membership.proof)
        try:
            conn = await ep.connect(parse_addr(mesh.worker.mesh_addr), mesh.worker.node_id, timeout=5.0)
            return await job(ep, conn)
        finally:
            await ep.close()

    return asyncio.run(main())


async def control(conn: Any, message: Any) -> Any:
    """One stage-control request; the worker's reply as a dict, or ``"reset"`` if it refused the stream."""
    stream = await conn.open_stream(CONTROL)
    try:
        await stream.send(message)
        reply = await stream.recv(Any, timeout=10.0)
    except NetError:
        return "reset"
    return reply


def test_host_by_path_is_no_file_oracle(mesh: Mesh, tmp_path: Path) -> None:
    """Whether a path exists on the worker, and its hash, must not leak to a member."""
    existing = str(mesh.gguf)  # the worker's machine has this file (the tests share one disk)
    missing = str(tmp_path / "no-such-file.gguf")

    async def job(_ep: Endpoint, conn: Any) -> list[Any]:
        replies = []
        for path in (existing, missing):
            replies.append(await control(conn, {"type": "host", "model": "probe", "path": path, "sha256": "0" * 64,
                                                "layer_start": 0, "layer_end": 1, "max_context": 16}))
        return replies

    with_file, without = attacker_run(mesh, job)
    assert with_file == without, f"the worker told apart an existing path from a missing one: {with_file!r}"
    assert "sha256" not in str(with_file) and existing not in str(with_file)


def test_a_member_outside_the_plan_cannot_open_sessions_on_a_stage(mesh: Mesh) -> None:
    """A forged chain naming the attacker as coordinator gets no compute from the worker."""
    start, end = mesh.worker_range

    async def job(ep: Endpoint, conn: Any) -> list[Any]:
        me = Hop(ep.node_id, "127.0.0.1:1", 0, start)
        them = Hop(mesh.worker.node_id, mesh.worker.mesh_addr, start, end)
        stream = await conn.open_stream(LANE, max_frame=LANE_FRAME_MAX)
        await stream.send(Open(session="attack-1", model=MODEL, layer_start=start, layer_end=end, chain=[me, them],
                               index=1, max_context=64))
        x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
        await stream.send(Prefill(session="attack-1", pos=0, n_tokens=2, dtype="f32", shape=(2, 64),
                                  activations=codec.encode(x, "f32"), sample=True))
        replies = []
        # the worker answers on this lane (errors) or opens one back to "chain[0]" (tokens); collect both
        got: asyncio.Queue[Any] = asyncio.Queue()

        async def lane_back(s: Any, _peer: Any) -> None:
            while (frame := await s.recv(Any, timeout=5.0)) is not None:
                await got.put(frame)

        ep.on_stream(LANE, lane_back, max_frame=LANE_FRAME_MAX)
        with contextlib.suppress(NetError):
            while len(replies) < 2:
                reader = asyncio.ensure_future(stream.recv(Any, timeout=3.0))
                back = asyncio.ensure_future(got.get())
                done, pending = await asyncio.wait({reader, back}, timeout=3.0, return_when=asyncio.FIRST_COMPLETED)
                for task in pending:
                    task.cancel()
                if not done:
                    break
                for task in done:
                    frame = task.result()
                    if frame is None:
                        raise NetError("lane ended")
                    replies.append(frame)
        return replies

    replies = attacker_run(mesh, job)
    assert not any(r.get("type") in ("tokens", "prefill", "decode") for r in replies if isinstance(r, dict)), replies
    errors = [r for r in replies if isinstance(r, dict) and r.get("type") == "error"]
    assert errors and errors[0]["code"] == "not-in-plan", replies


def test_release_from_a_non_coordinator_leaves_the_chain_serving(mesh: Mesh) -> None:
    """Only the coordinator that placed a stage may release it."""

    async def job(_ep: Endpoint, conn: Any) -> Any:
        return await control(conn, {"type": "release", "model": MODEL})

    reply = attacker_run(mesh, job)
    assert not (isinstance(reply, dict) and reply.get("type") == "released"), reply
    for _ in range(3):
        answer = mesh.completion()
        assert answer.status_code == 200, answer.text
    assert any(m["engine"] == "stage" for m in mesh.worker.status()["models"])
