"""Hypothesis strategies shared by the identity decoder property tests: valid bytes, mutated."""

from __future__ import annotations

from hypothesis import strategies as st


@st.composite
def mutated(draw: st.DrawFn, valid: bytes) -> bytes:
    """``valid`` with bit flips, a byte overwritten, truncation, extension, or a splice."""
    data = bytearray(valid)
    how = draw(st.sampled_from(["flip", "byte", "truncate", "extend", "splice"]))
    if how == "flip":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
    elif how == "byte":
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    elif how == "truncate":
        del data[draw(st.integers(0, len(data) - 1)):]
    elif how == "extend":
        data += draw(st.binary(min_size=1, max_size=64))
    else:
        start = draw(st.integers(0, len(data)))
        end = draw(st.integers(start, len(data)))
        data[start:end] = draw(st.binary(max_size=40))
    return bytes(data)


def random_or_mutated(valid: list[bytes]) -> st.SearchStrategy[bytes]:
    """Random bytes half the time, a mutation of one of ``valid`` otherwise."""
    return st.one_of(st.binary(max_size=400), st.sampled_from(valid).flatmap(mutated))
