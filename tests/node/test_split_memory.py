"""A model no single node may hold: with --max-memory below its size everywhere, --split auto still serves it.

The coordinator is not told to split: ``auto`` splits because the model's memory (as the ggml runtime
holds it: stored tensor bytes, f16 KV for the context, compute buffers per stage) exceeds its cap;
the workers offer no more than the same cap, so the chain needs more than one of them.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from nodes import NodeProcess, running_nodes
from tinymodels import write_tiny_llama

from meshllm.split.placement import model_profile
from meshllm.split.planner import GIB

pytestmark = pytest.mark.timeout(120)


def test_auto_split_serves_a_model_larger_than_every_node(tmp_path: Path) -> None:
    # wide enough that its layers, not the per-stage compute buffers, are most of its memory
    gguf = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=6, seed=3, width=256, heads=8, ffn=1024, context=256)
    whole = model_profile(gguf, 4096).whole_bytes
    cap = ["--max-memory", f"{0.8 * whole / GIB:.6f}"]
    with running_nodes() as nodes:
        solo = NodeProcess(tmp_path / "solo", ["--model", str(gguf)], "solo")
        coord = NodeProcess(tmp_path / "c", ["--model", str(gguf), "--split", "auto", *cap], "coord")
        nodes += [solo, coord]
        token = coord.wait_ready()["invite"]
        placing = coord.wait_event(lambda e: e["type"] == "split_placing", 10.0)
        assert placing["mode"] == "auto"
        nodes += [NodeProcess(tmp_path / f"w{i}", ["--worker", "--join", token, *cap], f"w{i}") for i in (1, 2)]
        ready = coord.wait_event(lambda e: e["type"] == "split_ready", 60.0)
        assert len(ready["stages"]) >= 2
        status = coord.status()
        assert status["splits"][0]["state"] == "ready"
        assert [d["kind"] for d in status["devices"]] == ["cpu"]  # this machine's llama-cpp-python: CPU only
        solo.wait_ready()
        kwargs = {"model": "tiny", "prompt": "Hello", "max_tokens": 24, "temperature": 0}
        ours = openai.OpenAI(base_url=coord.api + "/v1", api_key="x", max_retries=0)
        ref = openai.OpenAI(base_url=solo.api + "/v1", api_key="x", max_retries=0)
        assert ours.completions.create(**kwargs).choices[0].text == ref.completions.create(**kwargs).choices[0].text
