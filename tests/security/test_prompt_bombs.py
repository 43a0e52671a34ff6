"""Prompt bombs: a prompt that cannot fit the context is refused before the tokenizer works through it.

Finding (issue 29): 3.6 MB of rare Unicode, under the 4 MiB body cap, was still being tokenized
after 150 s on the default model (the same size of ASCII: 2.3 s to a 400); on the tiny model 500 KB
of ``"word "`` took 83 s to reach ``context_length_exceeded``. One request pegged a core. Now a
prompt longer than the context times the vocabulary's longest token is refused unread, and a long
one is counted in chunks that stop once the context is exceeded.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import httpx
import pytest
from nodes import NodeProcess, running_nodes
from tinymodels import write_tiny_llama

pytestmark = pytest.mark.timeout(120)


def bombs() -> dict[str, str]:
    rng = random.Random(29)
    rare = "".join(chr(rng.randrange(0x20000, 0x2A6DF)) for _ in range(900_000))  # CJK extension B, 4 bytes each
    return {"3.6 MB of rare Unicode": rare, "500 KB of 'word '": "word " * 100_000,
            "60 KB of rare Unicode": rare[:15_000]}


def test_prompt_bombs_are_refused_without_tokenizing_them(tmp_path: Path) -> None:
    gguf = write_tiny_llama(tmp_path / "tiny.gguf", seed=0)
    with running_nodes() as nodes:
        a = NodeProcess(tmp_path / "a", ["--model", str(gguf)], "a")
        nodes.append(a)
        a.wait_ready()
        took = {}
        for name, prompt in bombs().items():
            body = json.dumps({"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": prompt}]},
                              ensure_ascii=False).encode()
            start = time.monotonic()
            response = httpx.post(f"{a.api}/v1/chat/completions", content=body, timeout=30,
                                  headers={"content-type": "application/json"})
            took[name] = round(time.monotonic() - start, 2)
            assert response.status_code == 400, (name, response.status_code, response.text[:200])
            assert response.json()["error"]["code"] == "context_length_exceeded"
        print(f"refused in (s): {took}")
        ok = httpx.post(f"{a.api}/v1/chat/completions", timeout=30, json={
            "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200
