"""Speculation on the llama engine of real nodes started through the CLI (tiny Q8_0 model).

One node takes ``speculate = "on"`` from its ``config.toml``, the other runs ``--speculate off``; the
same greedy and seeded completions (plain and streamed, through the ``openai`` client) must give
the same text on both, and ``/api/status`` shows the model's speculation figures on the first.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import openai
import pytest
from nodes import NodeProcess, running_nodes
from tinymodels import write_tiny_llama

pytestmark = pytest.mark.timeout(120)

PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n" * 3


def test_llama_engine_speculation_gives_the_plain_text_and_reports_it(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "tiny-q8.gguf", seed=2, weight_type=gguf.GGMLQuantizationType.Q8_0)
    (tmp_path / "on").mkdir(mode=0o700)
    (tmp_path / "on" / "config.toml").write_text('speculate = "on"\n')
    with running_nodes() as nodes:
        on = NodeProcess(tmp_path / "on", ["--model", str(model), "--threads", "1"], "on")
        off = NodeProcess(tmp_path / "off", ["--model", str(model), "--threads", "1", "--speculate", "off"], "off")
        nodes += [on, off]
        on.wait_ready()
        off.wait_ready()
        clients = [openai.OpenAI(base_url=n.api + "/v1", api_key="x", max_retries=0, timeout=60) for n in (on, off)]
        for kwargs in ({"temperature": 0}, {"temperature": 0.8, "seed": 11}):
            request = {"model": "tiny-q8", "prompt": PROMPT, "max_tokens": 80, **kwargs}
            ours, plain = (c.completions.create(**request).choices[0].text for c in clients)  # type: ignore[call-overload]
            assert len(plain) > 20 and ours == plain
            streamed = "".join(c.choices[0].text for c in clients[0].completions.create(**request, stream=True)
                               if c.choices)  # type: ignore[call-overload]
            assert streamed == plain

        (served,) = on.status()["models"]
        spec = served["speculation"]
        assert spec["mode"] == "on" and spec["unavailable"] is None and spec["verify_passes"] > 3
        assert spec["accepted"] > 0 and spec["tokens_per_pass"] > 1.0 and spec["call_ms_by_rows"]
        assert off.status()["models"][0]["speculation"]["mode"] == "off"
