"""The numpy runtime against llama.cpp on the bundled Gemma 3 270M (Q4_K_M), and split across stages.

llama.cpp multiplies quantized weights by activations it quantizes to 8 bits, while we dequantize the
weights and compute in float32, so the logits differ slightly: we ask for the same greedy choice at
>= 90% of steps and a logit cosine similarity >= 0.99 at every step, feeding both engines the same
tokens (llama.cpp's own greedy continuation) so that one near-tie cannot derail the rest.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from stage_helpers import LLAMA_THREADS

from meshllm.engine.numpy.stage import StageModel
from meshllm.engine.numpy.weights import StageWeights

pytestmark = pytest.mark.slow

PROMPT = b"The quick brown fox jumps over the lazy dog. In the morning, the fox"
STEPS = 64


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_greedy_decode_matches_llama_cpp(default_model: Path, default_stage: StageModel) -> None:
    from llama_cpp import Llama

    llm = Llama(model_path=str(default_model), logits_all=True, n_ctx=512, n_threads=LLAMA_THREADS, verbose=False)
    try:
        prompt = llm.tokenize(PROMPT, add_bos=True)
        llm.eval(prompt)
        continuation, rows = [], []
        for step in range(STEPS):  # llama.cpp's greedy continuation and the logits that chose it
            rows.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
            continuation.append(int(np.argmax(rows[-1])))
            if step < STEPS - 1:
                llm.eval([continuation[-1]])
        ref = np.stack(rows)
    finally:
        llm.close()
    # prompt as one batch, 8 single-token decode steps, then the rest as one batch continuing the cache
    session = "greedy"
    ours = [default_stage.forward(session, np.array(prompt), 0, last_only=True)]
    pos = len(prompt)
    for token in continuation[:8]:
        ours.append(default_stage.forward(session, np.array([token]), pos))
        pos += 1
    ours.append(default_stage.forward(session, np.array(continuation[8:-1]), pos))
    default_stage.reset(session)
    logits = np.concatenate(ours)
    agree = np.mean([int(np.argmax(o)) == t for o, t in zip(logits, continuation, strict=True)])
    cosines = [_cosine(o, r) for o, r in zip(logits, ref, strict=True)]
    assert agree >= 0.9, f"greedy choices agree at {agree:.0%} of steps"
    assert min(cosines) >= 0.99, f"lowest logit cosine similarity {min(cosines):.4f}"


def _substage(whole: StageModel, start: int, end: int) -> StageModel:
    """Layers [start, end) of an already loaded model, sharing its arrays (loading again takes seconds)."""
    w = whole.weights
    last = end == whole.hparams.n_layers
    weights = StageWeights(
        layers=w.layers[start:end],
        # a tied first stage looks embeddings up in the head's columns, exactly as the whole model does
        head=w.head if start == 0 or last else None,
        output_norm=w.output_norm if last else None,
        rope_freqs=w.rope_freqs,
    )
    return StageModel(whole.hparams, weights, start, end, whole.max_context)


@pytest.mark.parametrize("k", [1, 6, 17])
def test_split_is_bit_identical(default_stage: StageModel, k: int) -> None:
    """[0, k) then [k, n) with the activations handed over equals [0, n), in prefill and decode."""
    n = default_stage.hparams.n_layers
    first, second = _substage(default_stage, 0, k), _substage(default_stage, k, n)
    tokens = [2, 818, 3823, 8864, 37423, 38167, 1024, 506]
    whole_logits = default_stage.forward("whole", np.array(tokens[:6]), 0)
    split_logits = second.forward("s", first.forward("s", np.array(tokens[:6]), 0), 0)
    assert np.array_equal(whole_logits, split_logits)
    for pos in range(6, len(tokens)):
        whole_logits = default_stage.forward("whole", np.array([tokens[pos]]), pos)
        split_logits = second.forward("s", first.forward("s", np.array([tokens[pos]]), pos), pos)
        assert np.array_equal(whole_logits, split_logits)
    default_stage.reset("whole")


def test_loaded_halves_hold_only_their_tensors_and_match(default_model: Path, default_stage: StageModel) -> None:
    """A last stage loaded from the file holds only its part and continues the whole model exactly.

    (Loading a first stage too would dequantize the 262144 x 640 embeddings once more; the tiny-model
    split tests load both sides.)
    """
    first = _substage(default_stage, 0, 9)
    second = StageModel.load(default_model, 9, 18, max_context=1024)
    assert second.last and not second.first
    assert second.weights.embed is None and second.weights.head is not None and len(second.weights.layers) == 9
    tokens = np.array([2, 818, 3823, 8864, 37423])
    whole = default_stage.forward("halves", tokens, 0)
    default_stage.reset("halves")
    assert np.array_equal(second.forward("s", first.forward("s", tokens, 0), 0), whole)
