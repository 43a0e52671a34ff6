"""A forced 3-stage split of the default model (Gemma 3 270M) over real nodes gives the solo numpy node's greedy text.

Few tokens: every node dequantizes its range of a 253 MB model and decodes at a few tokens per second.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from nodes import NodeProcess, running_nodes

pytestmark = pytest.mark.timeout(180)


def test_default_model_split_in_3_matches_solo(tmp_path: Path) -> None:
    with running_nodes() as nodes:
        solo = NodeProcess(tmp_path / "solo", ["--engine", "numpy"], "solo")
        coord = NodeProcess(tmp_path / "c", ["--split", "force", "--stages", "3"], "coord")
        nodes += [solo, coord]
        token = coord.wait_ready()["invite"]
        nodes += [NodeProcess(tmp_path / f"w{i}", ["--worker", "--join", token], f"w{i}") for i in (1, 2)]
        ready = coord.wait_event(lambda e: e["type"] == "split_ready", 120.0)
        assert len(ready["stages"]) == 3 and ready["stages"][-1][2] == 18
        solo.wait_ready(120.0)
        model = coord.status()["splits"][0]["model"]
        kwargs = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        ours = openai.OpenAI(base_url=coord.api + "/v1", api_key="x", max_retries=0, timeout=60)
        ref = openai.OpenAI(base_url=solo.api + "/v1", api_key="x", max_retries=0, timeout=60)
        expected = ref.completions.create(**kwargs).choices[0].text
        assert expected
        assert ours.completions.create(**kwargs).choices[0].text == expected
        streamed = "".join(c.choices[0].text for c in ours.completions.create(**kwargs, stream=True) if c.choices)
        assert streamed == expected
