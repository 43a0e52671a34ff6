"""Measure what loading a stage and running a prompt through it adds to a fresh process's RSS.

Run as ``python rss_probe.py MODEL START END CONTEXT N_TOKENS``; prints one JSON object. A fresh
process, so that nothing else the test run loaded is counted: the baseline is taken after the
imports and the ggml library check, the second reading after the stage ran ``N_TOKENS`` tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def rss_bytes() -> int:
    """VmRSS of this process (resident pages, the mapped model file's included)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    from meshllm.engine.ggml import lib
    from meshllm.engine.ggml.hparams import read_hparams
    from meshllm.engine.ggml.memory import estimate_memory
    from meshllm.engine.ggml.stage import StageModel
    from meshllm.engine.ggml.weights import plan_stage
    from meshllm.models.gguf_file import GGUFFile

    path, start, end, context, n = sys.argv[1], *map(int, sys.argv[2:6])
    lib.load()
    reader = GGUFFile(path)
    hp = read_hparams(reader)
    tensor_bytes = plan_stage(reader, hp, start, end).nbytes
    before = rss_bytes()
    stage = StageModel.load(path, start, end, max_context=context, threads=1)
    loaded = rss_bytes()
    rng = np.random.default_rng(0)
    inputs = rng.integers(3, min(hp.vocab, 250), n) if stage.first else rng.standard_normal((n, hp.width), np.float32)
    stage.forward("probe", inputs, 0, last_only=True)
    for pos in range(n, n + 8):  # a few decode steps: their graphs are the ones kept
        step = np.array([7]) if stage.first else rng.standard_normal((1, hp.width), np.float32)
        stage.forward("probe", step, pos)
    after = rss_bytes()
    print(json.dumps({
        "rss_before": before, "rss_loaded": loaded, "rss_after": after, "growth": after - before,
        "tensor_bytes": tensor_bytes, "kv_bytes": stage.memory()["kv"], "memory": stage.memory(),
        "estimate": estimate_memory(reader, start, end, context, hp=hp),
    }))


if __name__ == "__main__":
    main()
