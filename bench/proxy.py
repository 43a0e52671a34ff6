"""Overhead of serving through meshllm: llama-cpp-python called directly vs the node's API vs a routed hop.

Three paths, same prompts, same greedy settings, run interleaved prompt by prompt (this host is
shared and noisy, so a slow moment hits all three alike):

* ``direct``: llama-cpp-python in this process (``create_completion(stream=True)``), the floor;
* ``local``: ``POST /v1/completions`` (SSE) on node A, which serves the default model;
* ``routed``: the same request to node B (``--client``), which sends it to A over QUIC.

Reported per path: median time to first token and median decode speed (tokens after the first
over the time after the first), each as a ratio to ``direct``, and the median of the per-prompt
TTFT differences to ``direct`` (paired: the three paths run the same prompt back to back).

Two things keep the comparison fair on one small host. Every run's prompt starts with a tag of its
own, so no path finds its prompt in a prefix cache from an earlier run (and llama-cpp-python is
reset before each run, since it reuses even a few shared leading tokens). And llama.cpp
runs one thread on every path, for prefill as for decode (``--threads 1``; llama-cpp-python's own
default is every core for prefill): with both cores busy in llama.cpp, the routing node and the
client (which on a real mesh run on other machines) would steal its cycles.

    .venv/bin/python bench/proxy.py [--prompts 4] [--rounds 2] [--max-tokens 64] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from nodes import NodeProcess, running_nodes, wait_until

from meshllm.models import resolve_model

THREADS = 1
PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when",
    "A good recipe for bread needs only four things:",
    "In 1969 the first people to walk on the Moon",
    "Rivers carve valleys over millions of years because",
    "Octopuses are clever animals; for example, they",
    "My favourite programming language is",
]


def direct_run(llm: Any, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(time to first token, decode tok/s, tokens) for llama-cpp-python called directly.

    ``reset()`` first: llama-cpp-python keeps any common prefix of the previous prompt, even the 3-4
    tokens of "Note d" that the tags share, and would prefill less than the other paths.
    """
    llm.reset()
    start = time.perf_counter()
    first = last = 0.0
    n = 0
    for _chunk in llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, stream=True):
        last = time.perf_counter()
        if n == 0:
            first = last
        n += 1
    return first - start, (n - 1) / (last - first) if n > 1 else 0.0, n


def api_run(http: httpx.Client, api: str, model: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """The same over a node's API (SSE, on a kept-alive connection as an OpenAI client's), tokens counted
    by the server's usage."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = 0.0
    tokens = 0
    with http.stream("POST", f"{api}/v1/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                last = time.perf_counter()
                first = first or last
    return first - start, (tokens - 1) / (last - first) if tokens > 1 and last > first else 0.0, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "proxy.json")
    args = parser.parse_args()

    from llama_cpp import Llama

    ref = resolve_model("gemma", progress=False)
    llm = Llama(model_path=str(ref.path), n_ctx=4096, n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
    samples: dict[str, list[tuple[float, float, int]]] = {"direct": [], "local": [], "routed": []}
    with tempfile.TemporaryDirectory() as tmp, running_nodes() as nodes, httpx.Client(trust_env=False) as http:
        a = NodeProcess(Path(tmp) / "a", ["--model", "gemma", "--threads", str(THREADS)], "a")
        nodes.append(a)
        token = a.wait_ready()["invite"]
        b = NodeProcess(Path(tmp) / "b", ["--client", "--join", token], "b")
        nodes.append(b)
        b.wait_ready()
        wait_until(lambda: bool(httpx.get(f"{b.api}/v1/models").json()["data"]), 15)
        api_run(http, a.api, ref.model_id, "warm up", 4)
        api_run(http, b.api, ref.model_id, "warm up", 4)
        direct_run(llm, "warm up", 4)
        for rnd in range(args.rounds):
            for i, prompt in enumerate(PROMPTS[: args.prompts]):
                samples["direct"].append(direct_run(llm, f"Note d{rnd}{i}. {prompt}", args.max_tokens))
                samples["local"].append(api_run(http, a.api, ref.model_id, f"Note l{rnd}{i}. {prompt}",
                                                args.max_tokens))
                samples["routed"].append(api_run(http, b.api, ref.model_id, f"Note r{rnd}{i}. {prompt}",
                                                 args.max_tokens))

    rows = {}
    for path, runs in samples.items():
        rows[path] = {"ttft_ms": statistics.median(r[0] for r in runs) * 1000,
                      "decode_tok_s": statistics.median(r[1] for r in runs),
                      "tokens": statistics.median(r[2] for r in runs), "runs": len(runs)}
    for path, row in rows.items():
        row["decode_ratio"] = row["decode_tok_s"] / rows["direct"]["decode_tok_s"]
        row["ttft_ratio"] = row["ttft_ms"] / rows["direct"]["ttft_ms"]
        row["ttft_minus_direct_ms"] = statistics.median(
            (mine[0] - direct[0]) * 1000 for mine, direct in zip(samples[path], samples["direct"], strict=True))
    print(f"default model {ref.model_id}, {args.max_tokens} tokens max, greedy, "
          f"{args.prompts} prompts x {args.rounds} rounds, medians; load average {os.getloadavg()[0]:.2f}")
    print(f"{'path':8} {'TTFT ms':>9} {'- direct ms':>12} {'decode tok/s':>13} {'decode vs direct':>17} "
          f"{'TTFT vs direct':>15}")
    for path, row in rows.items():
        print(f"{path:8} {row['ttft_ms']:9.1f} {row['ttft_minus_direct_ms']:12.1f} {row['decode_tok_s']:13.1f} "
              f"{row['decode_ratio']:17.3f} {row['ttft_ratio']:15.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "bench": "proxy", "when": datetime.now(UTC).isoformat(timespec="seconds"), "host": platform.node(),
        "cpus": os.cpu_count(), "model": ref.model_id, "max_tokens": args.max_tokens, "results": rows,
        "samples": samples}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
