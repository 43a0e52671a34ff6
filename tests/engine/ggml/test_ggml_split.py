"""Layer splits on tiny models: each stage holds only its tensors, and a chain equals the whole model bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from stage_helpers import PROMPT

from meshllm.engine.ggml.errors import StageInputError
from meshllm.engine.ggml.hparams import read_hparams
from meshllm.engine.ggml.stage import StageModel
from meshllm.engine.ggml.weights import plan_stage
from meshllm.models.gguf_file import GGUFFile


def _run_chain(stages: list[StageModel], tokens: list[int], pos: int) -> np.ndarray:
    x: np.ndarray = np.array(tokens)
    for stage in stages:
        x = stage.forward("chain", x, pos)
    return x


def _load(path: Path, start: int = 0, end: int | None = None) -> StageModel:
    return StageModel.load(path, start, end, max_context=256, threads=1)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_gemma3"])
def test_every_two_stage_split_is_bit_identical(model: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(model)
    whole = _load(path)
    n = whole.hparams.n_layers
    expected = [whole.forward("w", np.array(PROMPT[:20]), 0)]
    expected += [whole.forward("w", np.array([t]), pos) for pos, t in enumerate(PROMPT[20:], start=20)]
    whole.close()
    for k in range(1, n):
        chain = [_load(path, 0, k), _load(path, k, n)]
        got = [_run_chain(chain, PROMPT[:20], 0)]
        got += [_run_chain(chain, [t], pos) for pos, t in enumerate(PROMPT[20:], start=20)]
        for stage in chain:
            stage.close()
        for e, g in zip(expected, got, strict=True):
            assert np.array_equal(e, g), f"split at {k} differs"


def test_three_stages_match_the_whole_model(tiny_gemma3: Path) -> None:
    whole = _load(tiny_gemma3)
    expected = whole.forward("w", np.array(PROMPT), 0)
    chain = [_load(tiny_gemma3, 0, 2), _load(tiny_gemma3, 2, 5), _load(tiny_gemma3, 5, 7)]
    assert np.array_equal(_run_chain(chain, PROMPT, 0), expected)


def test_stage_roles_and_outputs(tiny_llama: Path) -> None:
    first, middle, last = (_load(tiny_llama, a, b) for a, b in [(0, 1), (1, 3), (3, 4)])
    assert (first.first, first.last, middle.first, middle.last, last.first, last.last) == (
        True, False, False, False, False, True,
    )  # fmt: skip
    assert first.weights.embed is not None and first.weights.head is None
    assert middle.weights.embed is None and middle.weights.head is None
    assert last.weights.embed is None and last.weights.head is not None
    acts = first.forward("s", np.array(PROMPT[:5]), 0)
    assert acts.shape == (5, 64) and acts.dtype == np.float32
    assert last.forward("s", middle.forward("s", acts, 0), 0).shape == (5, 259)
    assert last.forward("t", middle.forward("t", acts, 0), 0, last_only=True).shape == (1, 259)


def test_plan_names_only_the_stage_tensors(tiny_llama: Path) -> None:
    reader = GGUFFile(tiny_llama)
    hp = read_hparams(reader)
    plan = plan_stage(reader, hp, 1, 3)
    assert {t.name for t in plan.tensors()} == {f"blk.{il}.{n}" for il in (1, 2) for n in plan.layers[0]}
    first = {t.name for t in plan_stage(reader, hp, 0, 1).tensors()}
    assert "token_embd.weight" in first and "output.weight" not in first
    last = {t.name for t in plan_stage(reader, hp, 3, 4).tensors()}
    assert {"output.weight", "output_norm.weight"} <= last and "token_embd.weight" not in last


def test_a_stage_maps_only_its_own_bytes(tiny_llama: Path) -> None:
    """Weights are used in place from the file; a stage accounts exactly its tensors' file bytes."""
    reader = GGUFFile(tiny_llama)
    hp = read_hparams(reader)
    for a, b in [(0, 1), (1, 3), (3, 4), (0, 4)]:
        stage = _load(tiny_llama, a, b)
        assert stage.weights.mapped_bytes + stage.weights.copied_bytes == plan_stage(reader, hp, a, b).nbytes
        assert set(stage.weights.placement) >= {f"blk.{il}.attn_q.weight" for il in range(a, b)}
        assert not any(name.startswith(f"blk.{il}.") for name in stage.weights.placement for il in range(4)
                       if not a <= il < b)
        stage.close()


def test_tied_head_is_the_embedding_table(tiny_gemma3: Path) -> None:
    """Gemma ties its head to token_embd: one table in the file, mapped once even when a stage uses it twice."""
    whole = _load(tiny_gemma3)
    embed, head = whole.weights.embed, whole.weights.head
    assert embed is not None and head is not None and whole.plan.tied
    assert embed.p.contents.data == head.p.contents.data  # the same bytes of the map, twice as a tensor
    last = _load(tiny_gemma3, 6, 7)
    assert last.weights.head is not None and last.weights.embed is None


def test_later_stage_rejects_token_ids_and_bad_inputs(tiny_llama: Path) -> None:
    second = _load(tiny_llama, 2, 4)
    with pytest.raises(StageInputError, match="float32 activations"):
        second.forward("s", np.array([1, 2, 3]), 0)
    with pytest.raises(StageInputError, match="float32 activations"):
        second.forward("s", np.zeros((2, 63), np.float32), 0)
    bad = np.zeros((2, 64), np.float32)
    bad[1, 3] = np.nan
    with pytest.raises(StageInputError, match="NaN"):
        second.forward("s", bad, 0)
    assert second.session_length("s") == 0
    first = _load(tiny_llama, 0, 2)
    with pytest.raises(StageInputError, match="vocabulary"):
        first.forward("s", np.array([1, 259]), 0)
    with pytest.raises(StageInputError, match="token ids"):
        first.forward("s", np.array([], dtype=np.int64), 0)


def test_unloaded_stage_refuses_work(tiny_llama: Path) -> None:
    stage = _load(tiny_llama)
    stage.forward("s", np.array(PROMPT[:4]), 0)
    stage.close()
    with pytest.raises(StageInputError, match="unloaded"):
        stage.forward("s", np.array(PROMPT[:4]), 4)
    stage.close()  # twice is harmless
