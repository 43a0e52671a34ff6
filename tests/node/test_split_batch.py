"""Batching on a split chain of real nodes started through the CLI (tiny model, 2 stages).

Concurrent chat requests through the OpenAI client give the text each gives alone; ``/api/status``
shows passes shared by several sessions; the peer record's load carries the chain's slots
(``--split-batch``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from nodes import NodeProcess, running_nodes, wait_until
from tinymodels import write_tiny_llama

pytestmark = pytest.mark.timeout(180)


def test_concurrent_requests_on_a_split_chain_give_their_text_alone(tmp_path: Path) -> None:
    gguf = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=6, seed=5)
    with running_nodes() as nodes:
        coord = NodeProcess(tmp_path / "c", ["--model", str(gguf), "--split", "force", "--stages", "2",
                                             "--split-batch", "6", "--speculate", "off"], "coord")
        nodes.append(coord)
        token = coord.wait_ready()["invite"]
        nodes.append(NodeProcess(tmp_path / "w", ["--worker", "--join", token], "w"))
        ready = coord.wait_event(lambda e: e["type"] == "split_ready", 60)
        client = openai.OpenAI(base_url=coord.api + "/v1", api_key="x", max_retries=0, timeout=60)

        def ask(i: int) -> str:
            sampling = {"temperature": 0} if i % 2 else {"temperature": 0.9, "seed": i}
            reply = client.completions.create(model=ready["model"], prompt=f"Request {i} says", max_tokens=24 + i,
                                              **sampling)
            return reply.choices[0].text

        alone = [ask(i) for i in range(6)]
        with ThreadPoolExecutor(6) as pool:
            together = list(pool.map(ask, range(6)))
        assert together == alone and all(alone)
        split = coord.status()["splits"][0]
        assert split["batching"]["batch"] == 6 and split["batching"]["mean_batch"] > 1.0
        # our record's load is republished every few seconds (serving.LOAD_PUBLISH_S), not at once
        wait_until(lambda: coord.status()["load"]["slots"] == 6, 15.0)
