"""A stage holds what estimate_memory says, and its process's RSS stays within the runtime's bound.

The bound (docs/engine.md): RSS growth of loading and running a stage <= 1.15 x (file bytes of its
tensors + its KV cache) + 64 MB. RSS is measured in a fresh process (``rss_probe.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tinymodels import write_tiny

from meshllm.engine.ggml.hparams import read_hparams
from meshllm.engine.ggml.kv_cache import kv_bytes_per_token, padded
from meshllm.engine.ggml.memory import compute_bytes, estimate_memory, memory_profile
from meshllm.engine.ggml.stage import StageModel
from meshllm.engine.ggml.weights import plan_stage
from meshllm.models.gguf_file import GGUFFile

PROBE = Path(__file__).with_name("rss_probe.py")
MB = 1 << 20


def rss_bound(tensor_bytes: int, kv_bytes: int) -> float:
    """What a loaded stage may add to its process's RSS."""
    return 1.15 * (tensor_bytes + kv_bytes + 64 * MB)


def probe(path: Path, start: int, end: int, context: int, n: int) -> dict[str, int]:
    out = subprocess.run([sys.executable, str(PROBE), str(path), str(start), str(end), str(context), str(n)],
                         capture_output=True, text=True, timeout=240, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("start", "end"), [(0, 4), (0, 1), (1, 3), (3, 4)])
def test_estimate_is_the_stage_parts(tiny_llama: Path, start: int, end: int) -> None:
    reader = GGUFFile(tiny_llama)
    hp = read_hparams(reader)
    plan = plan_stage(reader, hp, start, end)
    context = 300
    stage = StageModel.load(tiny_llama, start, end, max_context=context, threads=1)
    try:
        w = stage.weights
        assert w.mapped_bytes + w.copied_bytes == plan.nbytes
        kv = kv_bytes_per_token(end - start, hp.n_kv_heads * hp.head_dim) * padded(context)
        logits = hp.vocab * 4 if stage.last else 0
        expected = plan.nbytes + kv + compute_bytes(hp, context) + logits
        assert estimate_memory(tiny_llama, start, end, context) == expected
        # a full context: the cache holds exactly the estimated KV, and the compute buffers stay under the bound
        inputs = np.arange(context) % 256 + 3 if stage.first else np.zeros((context, 64), np.float32)
        stage.forward("s", inputs, 0)
        assert stage.memory()["kv"] == kv
        assert 0 < stage.compute_bytes <= compute_bytes(hp, context) + logits * context
    finally:
        stage.close()


def test_tied_head_counted_once_and_halves_add_up(tiny_gemma3: Path) -> None:
    reader = GGUFFile(tiny_gemma3)
    hp = read_hparams(reader)
    mem = memory_profile(reader, hp, 64)
    whole = estimate_memory(tiny_gemma3, 0, 7, 64)
    halves = estimate_memory(tiny_gemma3, 0, 3, 64) + estimate_memory(tiny_gemma3, 3, 7, 64)
    assert halves == whole + mem.embed_bytes + mem.compute_bytes  # the second stage maps the table too
    assert mem.tied


def test_first_and_last_can_be_asked_for(tiny_llama: Path) -> None:
    reader = GGUFFile(tiny_llama)
    mem = memory_profile(reader, read_hparams(reader), 16)
    middle = estimate_memory(tiny_llama, 1, 3, 16)
    assert estimate_memory(tiny_llama, 1, 3, 16, first=True) == middle + 259 * 64 * 4
    assert estimate_memory(tiny_llama, 1, 3, 16, last=True) == middle + (259 * 64 + 64) * 4 + mem.logits_bytes


def test_rss_of_a_tiny_stage_is_within_the_bound(tiny_llama: Path) -> None:
    r = probe(tiny_llama, 0, 4, 512, 300)
    assert r["growth"] <= rss_bound(r["tensor_bytes"], r["kv_bytes"]), r


@pytest.mark.slow
@pytest.mark.parametrize(("start", "end"), [(0, 18), (0, 6), (6, 18)])
def test_rss_of_default_model_stages_is_within_the_bound(gemma_model: Path, start: int, end: int) -> None:
    """Quantized weights in place (the numpy runtime held 1.6 GB for [0, 6)): growth within 1.15x + 64 MB."""
    r = probe(gemma_model, start, end, 1024, 200)
    assert r["growth"] <= rss_bound(r["tensor_bytes"], r["kv_bytes"]), r
    assert r["estimate"] >= r["tensor_bytes"] + r["kv_bytes"]


def test_moe_estimate_counts_every_experts_bytes(tmp_path: Path) -> None:
    """A stage of a mixture of experts holds all of them (any may be chosen): its estimate counts every
    expert's bytes, while its compute per token counts only the experts a token uses."""
    path = write_tiny("qwen3moe", tmp_path / "moe.gguf", n_expert=8, n_expert_used=2)
    reader = GGUFFile(path)
    hp = read_hparams(reader)
    mem = memory_profile(reader, hp, 64)
    layer = plan_stage(reader, hp, 0, hp.n_layers).layers[0]
    experts = [t for name, t in layer.items() if name.endswith("_exps.weight")]
    assert len(experts) == 3 and all(t.shape[2] == 8 for t in experts)
    assert mem.layer_bytes[0] == sum(t.nbytes for t in layer.values())
    unused = sum(t.n_elements for t in experts) * 6 // 8  # 6 of 8 experts idle for any one token
    assert mem.layer_params[0] == sum(t.n_elements for t in layer.values()) - unused
    stage = StageModel.load(path, 0, 2, max_context=64, threads=1)
    try:
        assert stage.weights.mapped_bytes + stage.weights.copied_bytes == sum(mem.layer_bytes[:2]) + mem.embed_bytes
    finally:
        stage.close()
