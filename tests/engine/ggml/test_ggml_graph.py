"""The graph builder refuses, in Python, every op argument that would make ggml assert (and abort)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from meshllm.engine.ggml import lib
from meshllm.engine.ggml.graph import Graph, GraphError


@pytest.fixture
def graph() -> Iterator[Graph]:
    g = Graph(lib.load(), max_tensors=32)
    yield g
    g.close()


def test_shape_mismatches_are_refused(graph: Graph) -> None:
    w = graph.new(lib.F32, 64, 32)
    with pytest.raises(GraphError, match="mul_mat"):
        graph.mul_mat(w, graph.new(lib.F32, 63, 4))
    x = graph.mul_mat(w, graph.new(lib.F32, 64, 4))
    assert x.ne == (32, 4, 1, 1)
    with pytest.raises(GraphError, match="add"):
        graph.add(x, graph.new(lib.F32, 5))
    with pytest.raises(GraphError, match="get_rows"):
        graph.get_rows(w, graph.new(lib.F32, 3))  # row ids must be i32
    with pytest.raises(GraphError, match="reshape"):
        graph.reshape(x, 33, 4)
    with pytest.raises(GraphError, match="view"):
        graph.view(x, (32, 5), (128,))  # one row past the end
    with pytest.raises(GraphError, match="permute"):
        graph.permute(x, 0, 0, 1, 2)
    with pytest.raises(GraphError, match="rope"):
        graph.rope(graph.new(lib.F32, 16, 2, 4), graph.new(lib.I32, 3), None, n_dims=16, mode=0, n_ctx_orig=0,
                   freq_base=1e4, freq_scale=1.0, ext_factor=0.0, attn_factor=1.0, beta_fast=32.0, beta_slow=1.0)
    q, k = graph.new(lib.F32, 16, 4, 2), graph.new(lib.F16, 16, 256, 1)
    with pytest.raises(GraphError, match="f16 mask"):
        graph.flash_attn(q, k, k, graph.new(lib.F32, 256, 4), 1.0)
    with pytest.raises(GraphError, match="mask does not cover"):
        graph.soft_max(graph.new(lib.F32, 256, 4, 2), graph.new(lib.F32, 256, 3), 1.0)


def test_context_capacity_is_enforced_before_ggml() -> None:
    g = Graph(lib.load(), max_tensors=2)
    try:
        g.new(lib.F32, 4)
        g.new(lib.F32, 4)
        with pytest.raises(GraphError, match="more than the 2 tensors"):
            g.new(lib.F32, 4)
    finally:
        g.close()
