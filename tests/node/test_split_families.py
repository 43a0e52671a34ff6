"""A dense and a mixture-of-experts family split over three real nodes give llama.cpp's greedy text.

For Qwen 3 (dense, q/k norms), Qwen 3 MoE (experts), gpt-oss (sinks, sliding window, biased
experts) and DeepSeek (latent attention: K and V of different widths, or a K-only cache): a coordinator with
``--split force --stages 3`` and two ``--worker`` nodes, all started through the CLI, answer a
greedy completion (streamed and not) with exactly the text of a solo ``--engine llama`` node
(llama.cpp) on the same tiny model.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from nodes import NodeProcess, running_nodes
from test_split_tiny import complete, split_ready
from tinymodels import write_tiny

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]


@pytest.mark.parametrize("family", ["qwen3", "qwen3moe", "gpt-oss", "deepseek2", "deepseek2-mla"])
def test_three_stage_split_gives_llama_cpps_text(family: str, tmp_path: Path) -> None:
    gguf = write_tiny(family, tmp_path / "tiny.gguf", n_layers=6, seed=3)
    model = "tiny"
    with running_nodes() as nodes:
        solo = NodeProcess(tmp_path / "solo", ["--engine", "llama", "--model", str(gguf)], "solo")
        coord = NodeProcess(tmp_path / "c", ["--model", str(gguf), "--split", "force", "--stages", "3"], "coord")
        nodes += [solo, coord]
        token = coord.wait_ready()["invite"]
        nodes += [NodeProcess(tmp_path / f"w{i}", ["--worker", "--join", token], f"w{i}") for i in (1, 2)]
        solo.wait_ready()
        ready = split_ready(coord, 3)
        names = [s[0] for s in ready["stages"]]
        assert names[0] == "coord" and len(set(names)) == 3
        ours = openai.OpenAI(base_url=coord.api + "/v1", api_key="x", max_retries=0)
        ref = openai.OpenAI(base_url=solo.api + "/v1", api_key="x", max_retries=0)
        expected = complete(ref, model, stream=False)
        assert expected
        assert complete(ours, model, stream=False) == expected
        assert complete(ours, model, stream=True) == expected
