"""Layer splits on tiny models: each stage loads only its tensors, and a chain equals the whole model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from stage_helpers import PROMPT

from meshllm.engine.numpy.gguf_file import GGUFFile
from meshllm.engine.numpy.hparams import read_hparams
from meshllm.engine.numpy.stage import StageModel
from meshllm.engine.numpy.weights import plan_stage


def _run_chain(stages: list[StageModel], tokens: list[int], pos: int) -> np.ndarray:
    x: np.ndarray = np.array(tokens)
    for stage in stages:
        x = stage.forward("chain", x, pos)
    return x


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_gemma3"])
def test_every_two_stage_split_is_bit_identical(model: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(model)
    whole = StageModel.load(path)
    n = whole.hparams.n_layers
    expected = [whole.forward("w", np.array(PROMPT[:20]), 0)]
    expected += [whole.forward("w", np.array([t]), pos) for pos, t in enumerate(PROMPT[20:], start=20)]
    for k in range(1, n):
        chain = [StageModel.load(path, 0, k), StageModel.load(path, k, n)]
        got = [_run_chain(chain, PROMPT[:20], 0)]
        got += [_run_chain(chain, [t], pos) for pos, t in enumerate(PROMPT[20:], start=20)]
        for e, g in zip(expected, got, strict=True):
            assert np.array_equal(e, g), f"split at {k} differs"


def test_three_stages_match_the_whole_model(tiny_gemma3: Path) -> None:
    whole = StageModel.load(tiny_gemma3).forward("w", np.array(PROMPT), 0)
    chain = [StageModel.load(tiny_gemma3, 0, 2), StageModel.load(tiny_gemma3, 2, 5), StageModel.load(tiny_gemma3, 5, 7)]
    assert np.array_equal(_run_chain(chain, PROMPT, 0), whole)


def test_stage_roles_and_outputs(tiny_llama: Path) -> None:
    first, middle, last = (StageModel.load(tiny_llama, a, b) for a, b in [(0, 1), (1, 3), (3, 4)])
    assert (first.first, first.last, middle.first, middle.last, last.first, last.last) == (
        True, False, False, False, False, True,
    )  # fmt: skip
    assert first.weights.embed is not None and first.weights.head is None
    assert middle.weights.embed is None and middle.weights.head is None
    assert last.weights.embed is None and last.weights.head is not None
    acts = first.forward("s", np.array(PROMPT[:5]), 0)
    assert acts.shape == (5, 64) and acts.dtype == np.float32
    assert last.forward("s", middle.forward("s", acts, 0), 0).shape == (5, 259)


def test_plan_names_only_the_stage_tensors(tiny_llama: Path) -> None:
    reader = GGUFFile(tiny_llama)
    hp = read_hparams(reader)
    names = {t.name for t in plan_stage(reader, hp, 1, 3).tensors()}
    assert names == {f"blk.{il}.{n}" for il in (1, 2) for n in plan_stage(reader, hp, 1, 3).layers[0]}
    first = {t.name for t in plan_stage(reader, hp, 0, 1).tensors()}
    assert "token_embd.weight" in first and "output.weight" not in first
    last = {t.name for t in plan_stage(reader, hp, 3, 4).tensors()}
    assert {"output.weight", "output_norm.weight"} <= last and "token_embd.weight" not in last


def test_tied_head_is_the_embedding_table(tiny_gemma3: Path) -> None:
    """Gemma ties its head to token_embd: a last stage loads it as the head, a whole model once."""
    last = StageModel.load(tiny_gemma3, 6, 7)
    whole = StageModel.load(tiny_gemma3)
    first = StageModel.load(tiny_gemma3, 0, 1)
    assert last.weights.head is not None and first.weights.embed is not None
    assert np.array_equal(last.weights.head, first.weights.embed.T)
    assert whole.weights.embed is None  # looked up in the head's columns


def test_later_stage_rejects_token_ids_and_bad_shapes(tiny_llama: Path) -> None:
    from meshllm.engine.numpy.errors import StageInputError

    second = StageModel.load(tiny_llama, 2, 4)
    with pytest.raises(StageInputError, match="float32 activations"):
        second.forward("s", np.array([1, 2, 3]), 0)
    with pytest.raises(StageInputError, match="float32 activations"):
        second.forward("s", np.zeros((2, 63), np.float32), 0)
    first = StageModel.load(tiny_llama, 0, 2)
    with pytest.raises(StageInputError, match="vocabulary"):
        first.forward("s", np.array([1, 259]), 0)
