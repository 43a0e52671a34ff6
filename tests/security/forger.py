"""A malicious ``--worker`` for tests: the real node, whose stages compute forged outputs.

Usage (tests/nodes.py ``entry``): ``python tests/security/forger.py join TOKEN --worker ...``: the
arguments of ``python -m meshllm``. Every stage this process hosts returns made-up results: a last
stage's logits make ``PWNED-by-F`` the argmax (the tiny models' byte vocabulary, id = byte + 3), a
middle stage's activations are scrambled. The forgery sits in the layers' output, before the stage
server records and forwards it, so the worker's own signed record shows what it really sent (the
strongest lie: consistent with itself, wrong against the model). Test-only: nothing in ``meshllm``
knows about it. With ``MESHLLM_FORGE_FROM=N`` in its environment it is honest for the first ``N - 1``
sessions it serves and forges from the ``N``-th on (a forger that waits out the first, audited request).
"""

from __future__ import annotations

import os
import sys

import numpy as np

from meshllm.engine.ggml.stage import StageModel

WORD = b"PWNED-by-F"
FORGE_FROM = int(os.environ.get("MESHLLM_FORGE_FROM", "1"))
_real_forward = StageModel.forward
_sessions: list[str] = []


def _forged_forward(self: StageModel, session: str, inputs: np.ndarray, pos: int, *, last_only: bool = False
                    ) -> np.ndarray:
    out = _real_forward(self, session, inputs, pos, last_only=last_only)
    if session not in _sessions:
        _sessions.append(session)
    if _sessions.index(session) + 1 < FORGE_FROM:
        return out
    if not self.last:
        return np.ascontiguousarray(np.roll(out, 1, axis=1) * np.float32(2.0))
    forged = out.copy()
    for row in range(forged.shape[0]):
        p = pos + (inputs.shape[0] - forged.shape[0]) + row  # the position whose logits this row is
        forged[row, WORD[p % len(WORD)] + 3] = forged[row].max() + 5.0
    return forged


if __name__ == "__main__":
    StageModel.forward = _forged_forward  # type: ignore[method-assign]
    from meshllm.cli.main import main

    sys.argv = ["meshllm", *sys.argv[1:]]
    main()
