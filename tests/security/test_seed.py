"""``seed`` is any 64-bit integer on every engine: ``-1`` is a seed like any other, never a 500.

Finding (issue 29): ``seed: -1`` was accepted by the API, and then the ggml engine's sampler (also a
split chain's last stage) refused it inside the request (numpy takes no negative seed): a 500.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from nodes import NodeProcess, running_nodes
from tinymodels import write_tiny_llama

pytestmark = pytest.mark.timeout(60)


def test_negative_seeds_are_seeds_on_the_ggml_engine(tmp_path: Path) -> None:
    gguf = write_tiny_llama(tmp_path / "tiny.gguf", seed=0)
    with running_nodes() as nodes:
        a = NodeProcess(tmp_path / "a", ["--engine", "ggml", "--model", str(gguf), "--threads", "1"], "a")
        nodes.append(a)
        a.wait_ready()
        texts = {}
        for seed in (-1, -1, -(2**63), 2**63 - 1, 2**64):
            reply = httpx.post(f"{a.api}/v1/completions", timeout=30, json={
                "model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 1.0, "seed": seed})
            texts.setdefault(seed, []).append((reply.status_code, reply.json()))
        print({seed: [s for s, _ in v] for seed, v in texts.items()})
        assert [s for s, _ in texts[-1]] == [200, 200]
        assert texts[-1][0][1]["choices"][0]["text"] == texts[-1][1][1]["choices"][0]["text"]  # a seed: repeatable
        assert texts[-(2**63)][0][0] == texts[2**63 - 1][0][0] == 200
        status, body = texts[2**64][0]
        assert status == 422 and body["error"]["param"] == "seed"  # beyond 64 bits: named, refused
