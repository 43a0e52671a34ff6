"""HTTP clients that hang up mid-stream on a split chain (real nodes started through the CLI).

Starlette ends a disconnected request by cancelling it through an anyio scope, which cancels every
await of the request's cleanup too. Each such client must still free its session on every stage: a
leaked session holds KV on the workers, and once a coordinator holds 32 on a worker, its new requests
are refused there. The workers' ``/api/status`` ``stages`` show the sessions open on their ranges.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import httpx
import pytest
from nodes import NodeProcess, running_nodes, wait_until
from tinymodels import write_tiny_llama

pytestmark = pytest.mark.timeout(120)

BODY = {"model": "tiny", "prompt": "Hello, world", "max_tokens": 400, "temperature": 0, "stream": True}


def _hang_up(api: str, after: int) -> int:
    """Stream a completion, read ``after`` events, and close the connection; the events read."""
    read = 0
    with httpx.Client(timeout=30) as client, client.stream("POST", api + "/v1/completions", json=BODY) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                read += 1
                if read == after:
                    break
    return read


def _open_sessions(workers: list[NodeProcess]) -> list[int]:
    return [sum(s["sessions"] for s in w.status()["stages"]) for w in workers]


def test_clients_hanging_up_mid_stream_leave_no_session_on_any_stage(tmp_path: Path) -> None:
    gguf = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=6, seed=3)
    with running_nodes() as nodes:
        coord = NodeProcess(tmp_path / "c", ["--model", str(gguf), "--split", "force", "--stages", "3"], "coord")
        nodes.append(coord)
        token = coord.wait_ready()["invite"]
        workers = [NodeProcess(tmp_path / f"w{i}", ["--worker", "--join", token], f"w{i}") for i in (1, 2)]
        nodes += workers
        for worker in workers:
            worker.wait_ready()
        coord.wait_event(lambda e: e["type"] == "split_ready" and len(e["stages"]) == 3, 60.0)
        full = {**BODY, "stream": False, "max_tokens": 24}
        reference = httpx.post(coord.api + "/v1/completions", json=full, timeout=30).json()["choices"][0]["text"]
        stages = [s for w in workers for s in w.status()["stages"]]
        assert len(stages) == 2 and all(s["owner"] == coord.node_id for s in stages)
        # a finished request frees its sessions after its answer (the coordinator sends Stop down the chain)
        wait_until(lambda: _open_sessions(workers) == [0, 0], 10.0)

        # 48 hang-ups, 8 at a time (so they share passes), each after 2 to 9 events
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            read = list(pool.map(lambda i: _hang_up(coord.api, 2 + i % 8), range(48)))
        assert read == [2 + i % 8 for i in range(48)]

        wait_until(lambda: _open_sessions(workers) == [0, 0], 10.0)
        again = httpx.post(coord.api + "/v1/completions", json=full, timeout=30).json()["choices"][0]["text"]
        assert again == reference  # the chain serves on, with the same text
        wait_until(lambda: _open_sessions(workers) == [0, 0], 10.0)
