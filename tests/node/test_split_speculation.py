"""Speculation on a split chain of real nodes started through the CLI (tiny model).

The coordinator takes ``speculate = "on"`` from its ``config.toml``; its greedy text must be exactly
what a solo ``--engine ggml`` node (the same runtime, plain decoding) gives, streamed and not, while
``/api/status`` shows windows that were verified, kept and rejected. ``--speculate`` refuses a bad
value before anything starts.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from nodes import NodeProcess, meshllm, running_nodes
from tinymodels import write_tiny, write_tiny_llama

pytestmark = pytest.mark.timeout(120)

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat"


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen35", marks=pytest.mark.slow)])
def test_speculative_split_gives_the_solo_text(family: str, tmp_path: Path) -> None:
    """Qwen 3.5's recurrent layers cannot be cut back: every stage rewinds its state past rejected drafts."""
    gguf = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=6, seed=3) if family == "llama" else \
        write_tiny(family, tmp_path / "tiny.gguf", n_layers=6, seed=3)
    (tmp_path / "c").mkdir(mode=0o700)
    (tmp_path / "c" / "config.toml").write_text('speculate = "on"\n')
    with running_nodes() as nodes:
        solo = NodeProcess(tmp_path / "solo", ["--engine", "ggml", "--model", str(gguf), "--speculate", "off"], "solo")
        coord = NodeProcess(tmp_path / "c", ["--model", str(gguf), "--split", "force", "--stages", "3"], "coord")
        nodes += [solo, coord]
        token = coord.wait_ready()["invite"]
        nodes += [NodeProcess(tmp_path / f"w{i}", ["--worker", "--join", token], f"w{i}") for i in (1, 2)]
        ready = coord.wait_event(lambda e: e["type"] == "split_ready", 60)
        solo.wait_ready()
        kwargs = {"model": ready["model"], "prompt": PROMPT, "max_tokens": 96, "temperature": 0}
        ours = openai.OpenAI(base_url=coord.api + "/v1", api_key="x", max_retries=0, timeout=60)
        ref = openai.OpenAI(base_url=solo.api + "/v1", api_key="x", max_retries=0, timeout=60)
        expected = ref.completions.create(**kwargs).choices[0].text
        assert len(expected) > 40
        assert ours.completions.create(**kwargs).choices[0].text == expected
        streamed = "".join(c.choices[0].text for c in ours.completions.create(**kwargs, stream=True) if c.choices)
        assert streamed == expected

        spec = coord.status()["splits"][0]["speculation"]
        if family == "qwen35":  # its random text repeats little: few windows, but drafts were rejected
            assert spec["mode"] == "on" and spec["verify_passes"] > 0 and spec["accepted"] < spec["drafted"]
            return
        assert spec["mode"] == "on" and spec["verify_passes"] > 5
        assert 0 < spec["accepted"] < spec["drafted"] and spec["tokens_per_pass"] > 1.0
        assert spec["pass_costs"]["per_token_ms"] > 0


def test_a_bad_speculate_value_is_a_usage_error(tmp_path: Path) -> None:
    done = meshllm("serve", "--home", str(tmp_path / "x"), "--speculate", "sometimes", timeout=30)
    assert done.returncode == 2 and "--speculate" in done.stderr and "Traceback" not in done.stderr
