"""``meshllm plan`` with no node running prices compute by timing this machine, not by a guess.

Finding (issue 29): ``meshllm plan default`` with no node running predicted 388 ms/token for a model
that decodes at 20-40 ms/token here: the compute was priced from a float32 matmul benchmark's
GFLOP/s, while decoding is bound by memory bandwidth. Now it times a decode step of the model's
first blocks with the stage runtime and says so.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from nodes import meshllm
from tinymodels import write_tiny_llama


def test_plan_without_a_node_measures_this_machine(tmp_path: Path) -> None:
    gguf = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=4, seed=0)
    with socket.socket() as sock:  # a port nobody listens on: no node answers
        sock.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{sock.getsockname()[1]}"
    done = meshllm("plan", str(gguf), "--api", nobody, "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    print(result["compute_source"], result["predicted_ms_per_token"])
    assert result["compute_source"].startswith("measured here")
    text = meshllm("plan", str(gguf), "--api", nobody).stdout
    assert "compute measured here" in text
