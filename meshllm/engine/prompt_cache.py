"""Which part of a slot's cached KV a new request may keep without changing its answer (pure functions).

llama.cpp's CPU kernels compute a batch row differently depending on how many rows the batch has
(it switches between matrix-vector, repacked and tiled matrix kernels), so the KV of a position
depends on the prefill chunk that computed it. A request's prompt is therefore always prefilled on
a fixed grid, chunks ``[0, C), [C, 2C), ...``, whatever else is running; and a slot may lend a new
request only whole grid chunks that it computed the same way, from the prompt's start. Then the
reused KV is bit-for-bit the KV the request would have computed, the remaining chunks are the
same chunks a fresh prefill would run, and the answer is the same with or without the cache.

Reuse also stops at least one token short of the prompt: the last prompt token must be computed
to give the logits of the first generated token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


def reusable(cached: Sequence[int], exact: int, prompt: Sequence[int], chunk: int) -> int:
    """Prompt tokens whose KV a slot holding ``cached`` can keep: a multiple of ``chunk``.

    ``exact`` is how many leading ``cached`` tokens the slot computed as whole grid chunks of a
    prefill; tokens it decoded one by one, or in a prompt's last, partial chunk, are not lent.
    """
    limit = min(exact, len(cached), len(prompt) - 1)
    if limit < chunk:
        return 0
    return common_prefix(cached[:limit], prompt[:limit]) // chunk * chunk


def grid_end(start: int, length: int, chunk: int) -> int:
    """End of the prefill chunk that starts at ``start`` in a ``length``-token input."""
    return min(length, (start // chunk + 1) * chunk)
