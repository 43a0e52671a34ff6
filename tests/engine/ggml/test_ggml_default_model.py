"""The ggml runtime against llama.cpp on the bundled Gemma 3 270M (Q4_K_M), and split across stages.

Configuration: the node's default ``exact`` kernels on both sides (weights in their file layout:
llama-cpp-python with ``use_extra_bufts=False``), f16 KV cache, flash attention off, one thread on
both sides, a 512-token context. In it the logits of a 64-step
greedy run are bit-identical to llama.cpp's at every step, so the greedy text is identical too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from stage_helpers import llama_cpp

from meshllm.engine.ggml.stage import StageModel

pytestmark = pytest.mark.slow

PROMPT = b"The quick brown fox jumps over the lazy dog. In the morning, the fox"
STEPS = 64


def test_64_greedy_steps_are_bit_identical_to_llama_cpp(gemma_model: Path, gemma_stage: StageModel) -> None:
    llm = llama_cpp(gemma_model, logits_all=True, n_ctx=512)
    try:
        prompt = llm.tokenize(PROMPT, add_bos=True)
        llm.eval(prompt)
        theirs, rows = [], []
        for step in range(STEPS):  # llama.cpp's greedy run and the logits that chose each token
            rows.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
            theirs.append(int(np.argmax(rows[-1])))
            if step < STEPS - 1:
                llm.eval([theirs[-1]])
        their_text = llm.detokenize(theirs).decode("utf-8", errors="replace")
    finally:
        llm.close()
    # ours, left to generate on its own: the prompt in one call, then one token per call
    ours, logits = [], [gemma_stage.forward("greedy", np.array(prompt), 0, last_only=True)[-1]]
    pos = len(prompt)
    for _ in range(STEPS):
        ours.append(int(np.argmax(logits[-1])))
        if len(ours) == STEPS:
            break
        logits.append(gemma_stage.forward("greedy", np.array([ours[-1]]), pos)[-1])
        pos += 1
    gemma_stage.reset("greedy")
    equal = sum(np.array_equal(a, b) for a, b in zip(logits, rows, strict=True))
    assert equal == STEPS, f"bit-identical at {equal} of {STEPS} steps"
    assert ours == theirs
    from meshllm.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(gemma_model, "gemma3", None)
    our_text = tokenizer.decode(ours)
    tokenizer.close()
    assert our_text == their_text and len(our_text) > 100


@pytest.mark.parametrize("k", [1, 6, 17])
def test_split_is_bit_identical(gemma_model: Path, gemma_stage: StageModel, k: int) -> None:
    """[0, k) then [k, n) loaded from the file, activations handed over, equals [0, n): prefill and decode."""
    n = gemma_stage.hparams.n_layers
    first = StageModel.load(gemma_model, 0, k, max_context=512, threads=1)
    second = StageModel.load(gemma_model, k, n, max_context=512, threads=1)
    try:
        assert first.first and not first.last and second.last and not second.first
        assert first.weights.head is None and second.weights.embed is None and len(second.weights.layers) == n - k
        tokens = [2, 818, 3823, 8864, 37423, 38167, 1024, 506]
        whole = gemma_stage.forward("whole", np.array(tokens[:6]), 0)
        split = second.forward("s", first.forward("s", np.array(tokens[:6]), 0), 0)
        assert np.array_equal(whole, split)
        for pos in range(6, len(tokens)):
            whole = gemma_stage.forward("whole", np.array([tokens[pos]]), pos)
            split = second.forward("s", first.forward("s", np.array([tokens[pos]]), pos), pos)
            assert np.array_equal(whole, split)
    finally:
        gemma_stage.reset("whole")
        first.close()
        second.close()
