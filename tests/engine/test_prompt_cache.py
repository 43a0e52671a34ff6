"""Which part of a cached prompt a new request may reuse: whole grid chunks, never its last token."""

from __future__ import annotations

import pytest

from meshllm.engine.prompt_cache import common_prefix, grid_end, reusable


@pytest.mark.parametrize(("a", "b", "n"), [((), (1,), 0), ((1, 2, 3), (1, 2, 4), 2), ((1, 2), (1, 2, 3), 2),
                                           ((5,), (6,), 0), (tuple(range(1000)), tuple(range(1000)), 1000)])
def test_common_prefix(a: tuple[int, ...], b: tuple[int, ...], n: int) -> None:
    assert common_prefix(a, b) == common_prefix(b, a) == n


def test_reuse_is_floored_to_the_grid_and_to_what_was_prefilled_whole() -> None:
    cached = list(range(20))
    assert reusable(cached, 16, list(range(30)), 4) == 16
    assert reusable(cached, 12, list(range(30)), 4) == 12  # [12, 20) was decoded or a partial chunk
    assert reusable(cached, 16, [*range(10), 99, 99], 4) == 8  # diverges at 10
    assert reusable(cached, 16, list(range(3)), 4) == 0


def test_reuse_leaves_the_last_prompt_token_to_compute() -> None:
    assert reusable(list(range(8)), 8, list(range(8)), 4) == 4
    assert reusable(list(range(8)), 8, list(range(9)), 4) == 8


def test_grid_end() -> None:
    assert [grid_end(s, 10, 4) for s in (0, 4, 8, 9)] == [4, 8, 10, 10]
