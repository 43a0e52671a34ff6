"""Sessions on hybrid stages (Qwen 3.5): the recurrent state is kept, rewound and freed like the KV cache.

A trim cannot cut a recurrent state back, so the stage rebuilds it from its checkpoint or from
position 0 with the session's kept inputs; these tests check that a trimmed session then computes
exactly what a session that never went past the trim point computes, through a chain of stages
(a first stage of recurrent layers only, a middle one, the last) as a split runs them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from stage_helpers import PROMPT
from tinymodels import HYBRID_FAMILIES, write_tiny

from meshllm.engine.ggml.errors import StageInputError
from meshllm.engine.ggml.recurrent import SNAPSHOTS
from meshllm.engine.ggml.stage import StageModel

RANGES = [(0, 1), (1, 3), (3, 4)]
"""Layers recurrent, attention, recurrent, attention: a first stage with no attention layer at all."""


@pytest.fixture(params=HYBRID_FAMILIES)
def chain(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[StageModel]]:
    path = write_tiny(request.param, tmp_path / f"{request.param}.gguf")
    stages = [StageModel.load(path, a, b, max_context=256, threads=1) for a, b in RANGES]
    yield stages
    for stage in stages:
        stage.close()


def run(stages: list[StageModel], session: str, tokens: list[int], pos: int) -> np.ndarray:
    x: np.ndarray = np.array(tokens)
    for stage in stages:
        x = stage.forward(session, x, pos)
    return x


def trim(stages: list[StageModel], session: str, n: int) -> None:
    for stage in stages:
        stage.trim(session, n)


def greedy(stages: list[StageModel], session: str, logits: np.ndarray, pos: int, steps: int) -> np.ndarray:
    rows = []
    for step in range(steps):
        logits = run(stages, session, [int(np.argmax(logits[-1]))], pos + step)
        rows.append(logits)
    return np.concatenate(rows)


def test_rejected_window_then_continue_equals_a_run_without_it(chain: list[StageModel]) -> None:
    """Speculation: a 4-token verify window of which 2 are kept, then 16 greedy steps."""
    prompt, window = PROMPT[:8], PROMPT[8:12]
    run(chain, "a", prompt, 0)
    ahead = run(chain, "a", window, 8)
    trim(chain, "a", 10)
    assert all(s.session_length("a") == 10 for s in chain)
    continued = greedy(chain, "a", ahead[:2], 10, 16)

    run(chain, "b", prompt, 0)
    kept = run(chain, "b", window[:2], 8)
    assert np.array_equal(ahead[:2], kept)
    assert np.array_equal(continued, greedy(chain, "b", kept, 10, 16))


@pytest.mark.parametrize("windows", [[(3, 1), (4, 0), (2, 2), (9, 2), (5, 4)]], ids=["windows"])
def test_windows_in_rounds_then_rewinds_equal_plain_decoding(chain: list[StageModel],
                                                              windows: list[tuple[int, int]]) -> None:
    """A split runs a verify window one row per call; each rejection rewinds to the kept length. The
    kept rows and everything after are bit for bit those of a session that only ever decoded them;
    a short rejection copies a snapshot back (no replay), a window longer than the snapshots replays
    from its anchor."""
    calls: list[int] = []  # rows of each call session "a" makes on the first stage (recurrent layers only)
    first = chain[0]
    real_run = first._run

    def counted(segments: list[tuple[str, object, int, int, int]], inputs: np.ndarray) -> np.ndarray:
        calls.extend(len(inputs) for s, *_ in segments if s == "a")
        return real_run(segments, inputs)  # type: ignore[arg-type]

    first._run = counted  # type: ignore[assignment]
    logits = run(chain, "a", PROMPT[:8], 0)
    plain = [run(chain, "b", PROMPT[:8], 0)]
    pos, rng = 8, np.random.default_rng(5)
    speculating = False
    for size, keep in windows:
        token = int(np.argmax(logits[-1]))
        window = [token, *rng.integers(3, 259, size - 1).tolist()]
        rows = [run(chain, "a", [t], pos + i) for i, t in enumerate(window)]
        kept = window[: keep + 1]
        trim(chain, "a", pos + len(kept))
        for i, t in enumerate(kept):
            plain.append(run(chain, "b", [t], pos + i))
            assert np.array_equal(rows[i], plain[-1]), (size, keep, i)
        pos += len(kept)
        logits = rows[len(kept) - 1]
        calls.clear()
        nxt = int(np.argmax(logits[-1]))
        assert np.array_equal(run(chain, "a", [nxt], pos), run(chain, "b", [nxt], pos))
        # replayed (each kept row as the call it ran as) when not speculating yet (from the anchor the
        # prompt left) or when the rejected rows outnumber the snapshots (from the last rewind's anchor);
        # else a snapshot is copied back and only the step itself runs
        replayed = not speculating or size - len(kept) >= SNAPSHOTS
        assert calls == [1] * (len(kept) + 1 if replayed else 1), (size, keep, calls)
        speculating = True
        trim(chain, "a", pos)
        trim(chain, "b", pos)


def test_trim_before_the_checkpoint_reprefills_from_the_kept_inputs(chain: list[StageModel]) -> None:
    """A rewind past every checkpoint (decode steps keep none) rebuilds from position 0."""
    logits = run(chain, "a", PROMPT[:8], 0)
    greedy(chain, "a", logits, 8, 4)
    trim(chain, "a", 5)
    continued = run(chain, "a", PROMPT[5:9], 5)

    run(chain, "b", PROMPT[:5], 0)
    assert np.array_equal(continued, run(chain, "b", PROMPT[5:9], 5))
    trim(chain, "a", 0)  # back to nothing: the state is zeros again
    assert np.array_equal(run(chain, "a", PROMPT[:8], 0), logits)


def test_reset_frees_the_state_and_a_new_session_starts_clean(chain: list[StageModel]) -> None:
    first = run(chain, "a", PROMPT[:8], 0)
    assert all(s.memory()["recurrent"] > 0 for s in chain if s.recurrent)
    for stage in chain:
        stage.reset("a")
    assert all(s.memory()["recurrent"] == 0 for s in chain)
    assert np.array_equal(run(chain, "a", PROMPT[:8], 0), first)


def run_batch(stages: list[StageModel], steps: list[tuple[str, list[int], int]]) -> list[np.ndarray]:
    xs: list[np.ndarray] = [np.array(tokens) for _, tokens, _ in steps]
    for stage in stages:
        xs = stage.forward_batch([(s, x, pos) for (s, _, pos), x in zip(steps, xs, strict=True)])
    return xs


def test_a_batch_of_sessions_computes_each_as_alone(chain: list[StageModel]) -> None:
    """Serving: sessions batched in one graph (each row through its own session's state), prompts, then
    greedy steps with a window among them, give each session what it computes alone (lone rows padded)."""
    for stage in chain:
        stage.batch_exact()
    prompts = {"a": PROMPT[:8], "b": PROMPT[8:14]}
    batched = dict(zip(prompts, run_batch(chain, [(s, p, 0) for s, p in prompts.items()]), strict=True))
    for s, p in prompts.items():
        assert np.array_equal(batched[s], run(chain, s + "'", p, 0))
    pos = {s: len(p) for s, p in prompts.items()}
    for step in range(6):
        nxt = {s: [int(np.argmax(batched[s][-1]))] for s in prompts}
        if step == 3:  # a window of three for "a" (the draft: its next token repeated), cut back to two
            nxt["a"] = nxt["a"] * 3
        outs = run_batch(chain, [(s, nxt[s], pos[s]) for s in prompts])
        for s, out in zip(prompts, outs, strict=True):
            assert np.array_equal(out, run(chain, s + "'", nxt[s], pos[s])), (s, step)
            batched[s] = out[:2]
            pos[s] += len(out[:2])
        if step == 3:
            trim(chain, "a", pos["a"])
            trim(chain, "a'", pos["a"])
    assert chain[0].pad_lone_rows  # f32 weights: a lone row took a scratch row beside it


def test_a_step_at_the_wrong_position_changes_nothing(chain: list[StageModel]) -> None:
    run(chain, "a", PROMPT[:8], 0)
    with pytest.raises(StageInputError, match="position 8"):
        chain[0].forward("a", np.array(PROMPT[8:10]), 6)
    assert np.array_equal(run(chain, "a", PROMPT[8:10], 8), run(chain, "b", PROMPT[:10], 0)[8:])
