"""A checked builder for ggml compute graphs: every op's preconditions are tested in Python first.

ggml validates op arguments with asserts that abort the process. The builders of the model families
(:mod:`~meshllm.engine.ggml.blocks`) therefore never call ggml directly: they call :class:`Graph`,
which checks shapes, types and contiguity the way ggml.c does for each op it offers, and raises
:class:`GraphError` instead. Tensors are plain handles (:class:`T`) whose shape is read back from
ggml's own struct, so the checks always see what ggml will see.

A graph owns one ggml context (metadata only, ``no_alloc``): its tensors get memory from the
scheduler that allocates the graph (:mod:`~meshllm.engine.ggml.runner`), or are views of tensors
that already live in a backend buffer (weights, KV caches).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

from meshllm.engine.ggml import lib
from meshllm.engine.ggml.errors import UnsupportedModel


class GraphError(UnsupportedModel):
    """A graph op was asked for with arguments ggml would abort on; nothing was handed to ggml."""


class T:
    """A ggml tensor handle; ``ne`` and ``nb`` are ggml's (``ne[0]`` is the contiguous dimension)."""

    __slots__ = ("p",)

    def __init__(self, p: lib.TensorP) -> None:
        if not p:
            raise GraphError("ggml returned no tensor")
        self.p = p

    @property
    def ne(self) -> tuple[int, int, int, int]:
        return tuple(self.p.contents.ne)  # type: ignore[return-value]

    @property
    def nb(self) -> tuple[int, int, int, int]:
        return tuple(self.p.contents.nb)  # type: ignore[return-value]

    @property
    def type(self) -> int:
        return int(self.p.contents.type)

    @property
    def n_elements(self) -> int:
        return math.prod(self.ne)

    def __repr__(self) -> str:
        return f"T(type={self.type}, ne={self.ne})"


def _same_shape(a: T, b: T) -> bool:
    return a.ne == b.ne


def _can_repeat(small: T, big: T) -> bool:
    """ggml_can_repeat: ``big`` is a whole number of copies of ``small`` along every dimension."""
    return all(s > 0 and b % s == 0 for s, b in zip(small.ne, big.ne, strict=True))


class Graph:
    """One ggml context and the compute graph built in it; :meth:`close` frees both."""

    def __init__(self, g: lib.Ggml, max_tensors: int) -> None:
        self.g = g
        self.max_tensors = max_tensors
        size = g.ggml_tensor_overhead() * max_tensors + g.ggml_graph_overhead_custom(max_tensors, False)
        self.ctx = g.ggml_init(lib.InitParams(size, None, True))
        if not self.ctx:
            raise GraphError(f"ggml_init could not reserve {size} bytes for a graph")
        self.gf = g.ggml_new_graph_custom(self.ctx, max_tensors, False)
        self._made = 0

    def close(self) -> None:
        if self.ctx:
            self.g.ggml_free(self.ctx)
            self.ctx = None

    # -- bookkeeping ----------------------------------------------------------------------------

    def _count(self, n: int = 1) -> None:
        """ggml aborts when a context runs out of room: count tensors before asking for one more."""
        if self._made + n > self.max_tensors:
            raise GraphError(f"graph needs more than the {self.max_tensors} tensors it was sized for")
        self._made += n

    def _fail(self, op: str, why: str, *tensors: T) -> GraphError:
        shapes = ", ".join(f"{t.ne}/{self.type_name(t.type)}" for t in tensors)
        return GraphError(f"ggml {op}: {why} ({shapes})")

    def type_name(self, type_id: int) -> str:
        name = self.g.ggml_type_name(type_id)
        return name.decode() if name else f"type {type_id}"

    def nbytes(self, t: T) -> int:
        return int(self.g.ggml_nbytes(t.p))

    def contiguous(self, t: T) -> bool:
        return bool(self.g.ggml_is_contiguous(t.p))

    # -- leaves -------------------------------------------------------------------------------------

    def new(self, type_id: int, *ne: int, name: str | None = None, input: bool = False) -> T:
        """A new tensor of ``type_id`` and shape ``ne`` (1 to 4 dimensions, each >= 1)."""
        if not 1 <= len(ne) <= lib.MAX_DIMS or any(d < 1 for d in ne):
            raise GraphError(f"cannot make a tensor of shape {ne}")
        self._count()
        dims = (ctypes.c_int64 * len(ne))(*ne)
        t = T(self.g.ggml_new_tensor(self.ctx, type_id, len(ne), dims))
        if name:
            self.g.ggml_set_name(t.p, name.encode()[: lib.MAX_NAME - 1])
        if input:
            self.g.ggml_set_input(t.p)
        return t

    def output(self, t: T) -> T:
        """Keep ``t``'s memory after the graph ran (the allocator would otherwise reuse it)."""
        self.g.ggml_set_output(t.p)
        return t

    def expand(self, t: T) -> None:
        """Add ``t`` and everything it depends on to the graph, in dependency order."""
        self.g.ggml_build_forward_expand(self.gf, t.p)

    # -- ops ------------------------------------------------------------------------------------------

    def _op(self, fn: ctypes._CFuncPtr, *args: object) -> T:
        self._count()
        return T(fn(self.ctx, *args))

    def mul_mat(self, a: T, b: T) -> T:
        """``a`` [k, n] (a weight) times ``b`` [k, m] -> [n, m] (ggml quantizes ``b`` to ``a``'s dot type)."""
        A, B = a.ne, b.ne
        if A[0] != B[0] or B[2] % A[2] or B[3] % A[3]:
            raise self._fail("mul_mat", "inner dimensions or broadcast do not match", a, b)
        if a.nb[0] > a.nb[1]:
            raise self._fail("mul_mat", "the first operand is transposed", a, b)
        return self._op(self.g.ggml_mul_mat, a.p, b.p)

    def mul_mat_id(self, experts: T, b: T, ids: T) -> T:
        """Per token, ``experts[ids[i, t]]`` [k, n] times ``b[:, i or 0, t]``: -> [n, n_used, tokens].

        ``experts`` [k, n, n_expert] is a stack of matrices; ``b`` [k, 1 or n_used, tokens]; ``ids``
        [n_used, tokens] i32 (which experts each token uses). ggml asserts all of this, so it is checked here.
        """
        A, B, ids_ne = experts.ne, b.ne, ids.ne
        if (ids.type != lib.I32 or ids_ne[2:] != (1, 1) or ids_ne[1] != B[2] or A[0] != B[0]
                or ids_ne[0] % B[1] or B[3] != 1 or A[3] != 1):
            raise self._fail("mul_mat_id", "experts, input and expert ids do not line up", experts, b, ids)
        if experts.nb[0] > experts.nb[1]:
            raise self._fail("mul_mat_id", "the expert stack is transposed", experts)
        return self._op(self.g.ggml_mul_mat_id, experts.p, b.p, ids.p)

    def argsort_top_k(self, a: T, k: int) -> T:
        """Indices (i32) of the ``k`` largest values of each row of ``a`` [n, rows], largest first."""
        if a.type != lib.F32 or not 0 < k <= a.ne[0]:
            raise self._fail("argsort_top_k", f"cannot take the top {k} of f32 rows", a)
        return self._op(self.g.ggml_argsort_top_k, a.p, k)

    def soft_max_rows(self, a: T) -> T:
        """Softmax of each row of ``a`` (no mask, no scale)."""
        if a.type != lib.F32 or not self.contiguous(a):
            raise self._fail("soft_max", "needs contiguous f32 rows", a)
        return self._op(self.g.ggml_soft_max, a.p)

    def sigmoid(self, a: T) -> T:
        return self._op(self.g.ggml_sigmoid, a.p)

    def silu(self, a: T) -> T:
        return self._op(self.g.ggml_silu, a.p)

    def sum_rows(self, a: T) -> T:
        """Each row's sum: [n, rows...] -> [1, rows...]."""
        return self._op(self.g.ggml_sum_rows, a.p)

    def clamp(self, a: T, lo: float, hi: float) -> T:
        return self._op(self.g.ggml_clamp, a.p, lo, hi)

    def div(self, a: T, b: T) -> T:
        if not _can_repeat(b, a):
            raise self._fail("div", "the second operand does not broadcast to the first", a, b)
        return self._op(self.g.ggml_div, a.p, b.p)

    def cont(self, a: T) -> T:
        """A contiguous copy of ``a`` (same shape)."""
        return self._op(self.g.ggml_cont, a.p)

    def f32_accumulation(self, t: T) -> T:
        """Ask the op behind ``t`` to accumulate in f32 (as llama.cpp does for attention scores)."""
        self.g.ggml_prec_set_acc(t.p, lib.PREC_F32)
        return t

    def add(self, a: T, b: T) -> T:
        if not _can_repeat(b, a):
            raise self._fail("add", "the second operand does not broadcast to the first", a, b)
        return self._op(self.g.ggml_add, a.p, b.p)

    def mul(self, a: T, b: T) -> T:
        if not _can_repeat(b, a):
            raise self._fail("mul", "the second operand does not broadcast to the first", a, b)
        return self._op(self.g.ggml_mul, a.p, b.p)

    def scale(self, a: T, s: float) -> T:
        if not self.contiguous(a):
            raise self._fail("scale", "needs a contiguous tensor", a)
        return self._op(self.g.ggml_scale, a.p, s)

    def tanh(self, a: T) -> T:
        return self._op(self.g.ggml_tanh, a.p)

    def rms_norm(self, a: T, eps: float) -> T:
        if a.type != lib.F32:
            raise self._fail("rms_norm", "needs f32", a)
        return self._op(self.g.ggml_rms_norm, a.p, eps)

    def get_rows(self, a: T, rows: T) -> T:
        A, R = a.ne, rows.ne
        if rows.type != lib.I32 or A[2] != R[1] or A[3] != R[2] or R[3] != 1:
            raise self._fail("get_rows", "row ids must be i32 and match the table's batch dimensions", a, rows)
        return self._op(self.g.ggml_get_rows, a.p, rows.p)

    def set_rows(self, dst: T, src: T, rows: T) -> T:
        """Write the rows of ``src`` into ``dst`` at the indices in ``rows``; returns a view of ``dst``."""
        D, S, R = dst.ne, src.ne, rows.ne
        if (
            D[0] != S[0] or D[2] != S[2] or D[3] != S[3] or S[1] != R[0] or S[2] % R[1] or S[3] % R[2] or R[3] != 1
            or src.type not in (lib.F32, lib.F16) or rows.type not in (lib.I64, lib.I32)
        ):
            raise self._fail("set_rows", "destination, source and indices do not line up", dst, src, rows)
        return self._op(self.g.ggml_set_rows, dst.p, src.p, rows.p)

    def reshape(self, a: T, *ne: int) -> T:
        if math.prod(ne) != a.n_elements or not self.contiguous(a) or len(ne) not in (2, 3, 4):
            raise self._fail("reshape", f"cannot reshape to {ne}", a)
        fn = {2: self.g.ggml_reshape_2d, 3: self.g.ggml_reshape_3d, 4: self.g.ggml_reshape_4d}[len(ne)]
        return self._op(fn, a.p, *ne)

    def fill(self, a: T, value: float) -> T:
        """A new tensor of ``a``'s shape, every element ``value``."""
        if a.type != lib.F32:
            raise self._fail("fill", "needs f32", a)
        return self._op(self.g.ggml_fill, a.p, value)

    def view(self, a: T, ne: Sequence[int], nb: Sequence[int], offset: int = 0) -> T:
        """A view of ``a``: shape ``ne`` (2 or 3 dims), strides ``nb[1:]`` in bytes, at byte ``offset``."""
        if len(ne) not in (2, 3) or len(nb) != len(ne) - 1 or any(d < 1 for d in ne) or offset < 0:
            raise self._fail("view", f"bad view {ne} {nb} @{offset}", a)
        row = int(self.g.ggml_row_size(a.type, ne[0]))
        dense = row * math.prod(ne[1:])
        extent = offset + row + sum((d - 1) * s for d, s in zip(ne[1:], nb, strict=True))
        if offset + dense > self.nbytes(a) or extent > self.nbytes(a):
            raise self._fail("view", f"view {ne} strides {nb} at {offset} overruns the tensor", a)
        if len(ne) == 2:
            return self._op(self.g.ggml_view_2d, a.p, ne[0], ne[1], nb[0], offset)
        return self._op(self.g.ggml_view_3d, a.p, ne[0], ne[1], ne[2], nb[0], nb[1], offset)

    def transpose(self, a: T) -> T:
        """A view of ``a`` with its first two dimensions swapped."""
        return self._op(self.g.ggml_transpose, a.p)

    def permute(self, a: T, *axes: int) -> T:
        if sorted(axes) != [0, 1, 2, 3]:
            raise self._fail("permute", f"axes {axes} are not a permutation of 0..3", a)
        return self._op(self.g.ggml_permute, a.p, *axes)

    def cont_2d(self, a: T, ne0: int, ne1: int) -> T:
        if ne0 * ne1 != a.n_elements:
            raise self._fail("cont_2d", f"{ne0} x {ne1} elements", a)
        return self._op(self.g.ggml_cont_2d, a.p, ne0, ne1)

    def concat(self, a: T, b: T, dim: int) -> T:
        """``a`` then ``b`` along ``dim`` (same type, every other dimension equal)."""
        if not 0 <= dim < lib.MAX_DIMS or a.type != b.type or any(
                x != y for i, (x, y) in enumerate(zip(a.ne, b.ne, strict=True)) if i != dim):
            raise self._fail("concat", f"cannot join along dimension {dim}", a, b)
        return self._op(self.g.ggml_concat, a.p, b.p, dim)

    def rope(self, a: T, pos: T, freqs: T | None, *, n_dims: int, mode: int, n_ctx_orig: int, freq_base: float,
             freq_scale: float, ext_factor: float, attn_factor: float, beta_fast: float, beta_slow: float,
             offset: int = 0) -> T:
        """ggml_rope_ext over [head_dim, heads, n] with positions ``pos`` [n] (i32); ``offset``: the rotated
        dimensions start there (DeepSeek rotates each head's trailing ``n_dims``)."""
        if pos.type != lib.I32 or pos.ne[1:] != (1, 1, 1) or a.ne[2] != pos.ne[0] or mode & 1:
            raise self._fail("rope", "positions must be an i32 vector with one entry per token", a, pos)
        if offset < 0 or offset + n_dims > a.ne[0] or n_dims % 2:
            raise self._fail("rope", f"cannot rotate {n_dims} dimensions from {offset}", a)
        if freqs is not None and (freqs.type != lib.F32 or freqs.ne[0] < n_dims // 2):
            raise self._fail("rope", "frequency factors must be f32 with n_dims/2 entries", a, freqs)
        out = self._op(self.g.ggml_rope_ext, a.p, pos.p, freqs.p if freqs is not None else None, n_dims, mode,
                       n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow)
        if offset:
            self.g.ggml_rope_set_offset(out.p, offset)
        return out

    def repeat_4d(self, a: T, *ne: int) -> T:
        """``a`` tiled to shape ``ne`` (each dimension a multiple of ``a``'s)."""
        if len(ne) != 4 or any(d < 1 or d % s for d, s in zip(ne, a.ne, strict=True)):
            raise self._fail("repeat_4d", f"cannot tile to {ne}", a)
        return self._op(self.g.ggml_repeat_4d, a.p, *ne)

    def add_id(self, a: T, b: T, ids: T) -> T:
        """``a[:, i, t] + b[:, ids[i, t]]``: per-expert biases for the experts each token uses."""
        A, B, ids_ne = a.ne, b.ne, ids.ne
        if (ids.type != lib.I32 or a.type != lib.F32 or b.type != lib.F32 or A[0] != B[0]
                or ids_ne[0] != A[1] or ids_ne[1] != A[2] or ids_ne[2:] != (1, 1) or B[2:] != (1, 1)):
            raise self._fail("add_id", "rows, biases and expert ids do not line up", a, b, ids)
        return self._op(self.g.ggml_add_id, a.p, b.p, ids.p)

    def swiglu_oai(self, gate: T, up: T, alpha: float, limit: float) -> T:
        """gpt-oss's clamped SwiGLU (``gate`` clamped above at ``limit``, ``up`` to +-``limit``)."""
        if not _same_shape(gate, up) or not self.contiguous(gate) or not self.contiguous(up):
            raise self._fail("swiglu_oai", "gate and up must be contiguous and of the same shape", gate, up)
        return self._op(self.g.ggml_swiglu_oai, gate.p, up.p, alpha, limit)

    def add_sinks(self, attn: T, sinks: T, heads: int, *, flash: bool) -> T:
        """Give ``attn`` (a ``soft_max``, or with ``flash`` a ``flash_attn``) one learned sink logit per head."""
        if sinks.type != lib.F32 or sinks.ne != (heads, 1, 1, 1):
            raise self._fail("add_sinks", f"sinks must be f32 [{heads}]", attn, sinks)
        (self.g.ggml_flash_attn_ext_add_sinks if flash else self.g.ggml_soft_max_add_sinks)(attn.p, sinks.p)
        return attn

    def soft_max(self, a: T, mask: T, scale: float) -> T:
        A, M = a.ne, mask.ne
        if not self.contiguous(a) or not self.contiguous(mask) or mask.type not in (lib.F16, lib.F32):
            raise self._fail("soft_max_ext", "needs contiguous scores and an f16/f32 mask", a, mask)
        if M[0] != A[0] or M[1] < A[1] or A[2] % M[2] or A[3] % M[3]:
            raise self._fail("soft_max_ext", "mask does not cover the scores", a, mask)
        return self._op(self.g.ggml_soft_max_ext, a.p, mask.p, scale, 0.0)

    def flash_attn(self, q: T, k: T, v: T, mask: T, scale: float, softcap: float = 0.0) -> T:
        """Fused attention: q [d, n, heads], k/v [d, kv, kv_heads] (f16), mask [kv, >=n] f16."""
        Q, K, V, M = q.ne, k.ne, v.ne, mask.ne
        if Q[0] != K[0] or Q[2] % K[2] or Q[3] % K[3] or Q[3] != K[3] or Q[3] != V[3] or K[1] != V[1] or K[2] != V[2]:
            raise self._fail("flash_attn_ext", "q, k and v do not line up", q, k, v)
        if mask.type != lib.F16 or not self.contiguous(mask) or M[0] != K[1] or M[1] < Q[1] or Q[2] % M[2]:
            raise self._fail("flash_attn_ext", "needs a contiguous f16 mask covering [kv, n]", q, k, mask)
        if k.type != lib.F16 or v.type != lib.F16:
            raise self._fail("flash_attn_ext", "needs f16 keys and values", k, v)
        return self._op(self.g.ggml_flash_attn_ext, q.p, k.p, v.p, mask.p, scale, 0.0, softcap)

    def swiglu_fused(self, a: T) -> T:
        """``silu(first half) * second half`` of each row of ``a`` (a fused gate-and-up projection)."""
        if a.ne[0] % 2 or not self.contiguous(a):
            raise self._fail("swiglu", "needs contiguous rows of even length", a)
        return self._op(self.g.ggml_swiglu, a.p)

    def glu(self, kind: str, gate: T, up: T) -> T:
        """``act(gate) * up`` fused: ``kind`` is ``"gelu"`` (GeGLU) or ``"silu"`` (SwiGLU)."""
        if not _same_shape(gate, up) or gate.type != up.type or not self.contiguous(gate) or not self.contiguous(up):
            raise self._fail(f"{kind} glu", "gate and up must be contiguous and of the same shape", gate, up)
        fn = {"gelu": self.g.ggml_geglu_split, "silu": self.g.ggml_swiglu_split}[kind]
        return self._op(fn, gate.p, up.p)
