"""One sampling contract: the numpy sampler (ggml engine, split stages) and the llama.cpp engine's
sampler draw token ``k`` from ``step_uniform(seed, k)`` over the same candidates in the same order,
so the same logits give the same tokens on either, and either can resume the other's stream."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tinymodels import write_tiny_llama

from meshllm.engine.base import GenerationParams
from meshllm.engine.llama_native import NativeModel
from meshllm.engine.llama_sampling import SlotSampler
from meshllm.engine.sampler import Sampler

STEPS = 60


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NativeModel]:
    path = write_tiny_llama(tmp_path_factory.mktemp("contract") / "tiny.gguf")
    native = NativeModel(Path(path), vocab_only=True)
    yield native
    native.close()


def _logits(n_vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [rng.normal(0, 2.5, n_vocab).astype(np.float32) for _ in range(STEPS)]


@pytest.mark.parametrize("params", [
    GenerationParams(temperature=0.8, seed=1),
    GenerationParams(temperature=1.5, top_k=20, seed=2),
    GenerationParams(temperature=1.0, top_p=0.9, seed=3),
    GenerationParams(temperature=0.7, min_p=0.05, top_k=40, top_p=0.95, seed=4),
    GenerationParams(temperature=1.0, repeat_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2, seed=5),
    GenerationParams(temperature=0.0, seed=6),
], ids=["plain", "top-k", "top-p", "min-p", "penalties", "greedy"])
def test_both_samplers_give_the_same_tokens_from_the_same_logits(model: NativeModel, params: GenerationParams) -> None:
    logits = _logits(model.n_vocab)
    ours = Sampler(params)
    native = SlotSampler(model, params)
    try:
        a: list[int] = []
        b: list[int] = []
        for step, z in enumerate(logits):
            token = ours(z, a)
            assert token is not None
            a.append(token)
            other = native.sample(z, step)
            assert other is not None
            native.accept(other)
            b.append(other)
    finally:
        native.close()
    assert a == b
    assert params.temperature == 0.0 or len(set(a)) > 5  # really sampled, not one token over and over


def test_a_stream_begun_on_one_sampler_continues_on_the_other(model: NativeModel) -> None:
    """The llama.cpp engine draws 25 tokens, the numpy sampler resumes at step 25 (as a replay onto a
    split chain or a ggml node does): the tokens are those of one uninterrupted numpy stream."""
    params = GenerationParams(temperature=1.1, top_k=64, seed=77)
    logits = _logits(model.n_vocab)
    whole = Sampler(params)
    expected: list[int] = []
    for z in logits:
        token = whole(z, expected)
        assert token is not None
        expected.append(token)
    native = SlotSampler(model, params)
    try:
        begun = [native.sample(z, k) for k, z in enumerate(logits[:25])]
    finally:
        native.close()
    resumed = Sampler(params, step=25)
    rest = [resumed(z) for z in logits[25:]]
    assert begun + rest == expected
