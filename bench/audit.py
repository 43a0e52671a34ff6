"""Cost of split audits: recomputation time per request against the request's own time, and serving TPOT
with audits at rate 0, 0.05 and 1, side by side in one run.

Three real 2-stage chains (``meshllm serve --split force --stages 2 --split-audit R`` plus one
``--worker`` each, ``--threads 1`` everywhere: this host has 2 shared cores) serve greedy streamed
completions in rounds: each round runs a block of requests on every chain in turn, and waits for that
chain's audits to finish before the next chain's block, so one chain's audits never overlap another
chain's requests. Within a block requests go back to back, so a chain's own audits (at rate 1: every
request's) run beside its next requests: that is the interference measured. Reported per rate: median
TPOT (gap between streamed tokens), median request time, audits run / dropped, and the mean
recomputation time per audit with its ratio to the median request time.

    .venv/bin/python bench/audit.py [--gemma] [--rounds 3] [--block 4] [--tokens 32] [--out bench/results/audit.json]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from nodes import NodeProcess, running_nodes, wait_until
from tinymodels import write_tiny_llama

RATES = (0.0, 0.05, 1.0)
PROMPT = "Once upon a time, in a small village by the sea, there lived"


def streamed(api: str, model: str, tokens: int) -> tuple[float, float]:
    """(median seconds between streamed tokens, seconds for the whole request) of one greedy completion."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True}
    started = time.perf_counter()
    stamps = []
    with httpx.stream("POST", api + "/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(stamps[1:])]  # the first token's wait is the prompt
    return statistics.median(gaps), time.perf_counter() - started


def audits(node: NodeProcess) -> dict:
    (split,) = node.status(timeout=30)["splits"]
    return split["audits"]


def run(path: Path, model: str, rounds: int, block: int, tokens: int, tmp: Path) -> list[dict[str, object]]:
    with running_nodes() as nodes:
        coords = []
        for rate in RATES:
            coord = NodeProcess(tmp / f"c{rate}", ["--model", str(path), "--split", "force", "--stages", "2",
                                                    "--split-audit", str(rate), "--threads", "1"], f"c{rate}")
            nodes.append(coord)
            invite = coord.wait_ready(180)["invite"]
            home = tmp / f"w{rate}"
            home.mkdir(mode=0o700)  # the worker indexes the model's folder: it has the file, nothing to fetch
            (home / "config.toml").write_text(f"model_dirs = [{json.dumps(str(path.parent))}]\n")
            nodes.append(NodeProcess(home, ["--worker", "--join", invite, "--threads", "1"], f"w{rate}"))
            coords.append(coord)
        for coord in coords:
            coord.wait_event(lambda e: e["type"] == "split_ready", 600)
            streamed(coord.api, model, 4)  # warm the lanes; at rate > 0 this is the chain's audited first request
            wait_until(lambda c=coord: audits(c)["pending"] == 0, 300)
        tpot: dict[float, list[float]] = {r: [] for r in RATES}
        took: dict[float, list[float]] = {r: [] for r in RATES}
        for _ in range(rounds):
            for rate, coord in zip(RATES, coords, strict=True):
                for _ in range(block):
                    gap, total = streamed(coord.api, model, tokens)
                    tpot[rate].append(gap)
                    took[rate].append(total)
                wait_until(lambda c=coord: audits(c)["pending"] == 0, 300)
                time.sleep(0.5)  # the audit thread has returned its CPU before the next chain's block
        rows = []
        for rate, coord in zip(RATES, coords, strict=True):
            a = audits(coord)
            request_ms = statistics.median(took[rate]) * 1e3
            recompute_ms = a["total_ms"] / a["run"] if a["run"] else None
            rows.append({"rate": rate, "requests": len(took[rate]), "tpot_ms": statistics.median(tpot[rate]) * 1e3,
                         "request_ms": request_ms, "audits_run": a["run"], "audits_dropped": a["dropped"],
                         "audits_failed": a["failed"], "recompute_ms": recompute_ms,
                         "recompute_over_request": recompute_ms / request_ms if recompute_ms else None})
        base = rows[0]["tpot_ms"]
        for row in rows:
            row["tpot_vs_rate0"] = row["tpot_ms"] / base  # type: ignore[operator]
        return rows


def table(name: str, rows: list[dict[str, object]]) -> str:
    def f(v: object, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    lines = [f"{name}", "| audit rate | requests | TPOT ms | vs rate 0 | request ms | audits run | dropped | "
             "failed | recompute ms / audit | recompute / request |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rate']} | {r['requests']} | {f(r['tpot_ms'], '.2f')} | {f(r['tpot_vs_rate0'], '.3f')} | "
                     f"{f(r['request_ms'], '.0f')} | {r['audits_run']} | {r['audits_dropped']} | "
                     f"{r['audits_failed']} | {f(r['recompute_ms'], '.0f')} | "
                     f"{f(r['recompute_over_request'], '.2f')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gemma", action="store_true", help="the bundled default model instead of a tiny one")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", default="bench/results/audit.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.gemma:
            from meshllm.models.default import default_model_path

            path, name = default_model_path(), "gemma3 270M Q4_K_M"
        else:
            path = write_tiny_llama(Path(tmp) / "tiny.gguf", n_layers=6, width=256, ffn=512, seed=1)
            name = "tiny llama (6 x 256)"
        rows = run(path, path.stem, args.rounds, args.block, args.tokens, Path(tmp))
    print(table(f"{name}, 2 stages, {args.tokens} tokens per request", rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    out.write_text(json.dumps({"date": stamp, "model": name, "tokens": args.tokens, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
