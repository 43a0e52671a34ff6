"""Cost of split audits: recomputation time per request against the request's own time, and serving TPOT
with audits at rate 0, 0.05 and 1, side by side on one chain in one run.

One 2-stage chain over real QUIC endpoints on 127.0.0.1 in this process (even split, one ggml thread
per stage, as bench/split.py) serves greedy requests; the node's real :class:`Auditor` (its queue,
drop rule and one low-priority thread, one ggml thread) audits them at the block's rate, fetching
records from the worker's real record service on a failure. Rounds run a block of requests at each
rate in turn on the same chain and wait for the block's audits to finish before the next block, so
one rate's audits never overlap another rate's requests; within a block requests go back to back,
so audits run beside the next requests: that is the interference measured. Reported per rate:
median TPOT (time per token after the first), median request time, audits run / dropped / failed,
and the mean recomputation time per audit with its ratio to the median request time. First it
measures how far recomputed logits are from the chain's, on the chain's schedule (what audits do)
and as one prefill (what they must not do).

    .venv/bin/python bench/audit.py [--gemma] [--rounds 3] [--block 4] [--tokens 32] [--out bench/results/audit.json]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

from nacl.signing import SigningKey

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tinymodels import write_tiny_llama

from meshllm.engine.ggml import StageModel
from meshllm.engine.ggml.hparams import read_hparams
from meshllm.models.gguf_file import GGUFFile
from meshllm.net import Endpoint, EndpointOptions
from meshllm.split import Hop, SplitCoordinator, StageServer
from meshllm.split.audit import Recorder
from meshllm.split.auditor import Auditor, FinishedRequest, serve_records
from meshllm.split.frames import Sampling

RATES = (0.0, 0.05, 1.0)
MODEL = "bench"
PROMPT = [2, 12_000, 3_100, 573, 106, 2_311, 17, 1_002, 88, 5_101, 9, 431, 2_024, 616, 77, 1_501]


class Placement:
    """What the auditor needs of a placement: the model, its file, names, and where evictions go."""

    def __init__(self, path: Path) -> None:
        self.engine = types.SimpleNamespace(model_id=MODEL)
        self.ref = types.SimpleNamespace(path=path)
        self.evicted: list[object] = []

    def names(self) -> dict[str, str]:
        return {}

    def evict(self, _coordinator: object, nodes: list[str], reason: str) -> None:
        self.evicted.append((nodes, reason))


async def run(path: Path, rounds: int, block: int, tokens: int) -> list[dict[str, object]]:
    hp = read_hparams(GGUFFile(path))
    prompt = [t % hp.vocab for t in PROMPT]
    mid = hp.n_layers // 2
    keys = [SigningKey.generate(), SigningKey.generate()]
    eps = [await Endpoint.create(key, "127.0.0.1", 0, admit=lambda *_: None, local_proof=lambda: b"bench",
                                 options=EndpointOptions()) for key in keys]
    servers = [StageServer(ep) for ep in eps]
    hops = [Hop(ep.node_id, f"{ep.local_addr[0]}:{ep.local_addr[1]}", a, b)
            for ep, (a, b) in zip(eps, ((0, mid), (mid, hp.n_layers)), strict=True)]
    servers[1].host(MODEL, StageModel.load(path, mid, hp.n_layers, max_context=1024, threads=1))
    servers[1].recorder = Recorder()
    serve_records(eps[1], servers[1].recorder, keys[1])
    coordinator = SplitCoordinator(servers[0], MODEL, StageModel.load(path, 0, mid, max_context=1024, threads=1),
                                   hops, speculate="off")
    placement = Placement(path)
    auditors = {rate: Auditor(eps[0], rate=rate, seed=1) for rate in RATES}
    tpot: dict[float, list[float]] = {r: [] for r in RATES}
    took: dict[float, list[float]] = {r: [] for r in RATES}
    k = 0
    try:
        async for _ in coordinator.generate(prompt, max_tokens=4, session="warm"):
            pass
        for _ in range(rounds):
            for rate in RATES:
                auditor = auditors[rate]
                for _ in range(block):
                    k += 1
                    started = time.perf_counter()
                    stamps, out = [], []
                    async for t in coordinator.generate(prompt, max_tokens=tokens, session=f"r{k}"):
                        stamps.append(time.perf_counter())
                        out.append(t.token_id)
                    took[rate].append(stamps[-1] - started)
                    tpot[rate].append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
                    auditor.submit(placement, coordinator, FinishedRequest(f"r{k}", prompt, out, Sampling()))
                await auditor.idle()
                await asyncio.sleep(0.2)
    finally:
        for auditor in auditors.values():
            await auditor.close()
        for server in servers:
            server.close()
        for ep in eps:
            await ep.close()
    assert not placement.evicted, placement.evicted
    rows = []
    for rate in RATES:
        c = auditors[rate].counters.get(MODEL)
        per_audit = c.total_ms / c.run if c and c.run else None
        request_ms = statistics.median(took[rate]) * 1e3
        rows.append({"rate": rate, "requests": len(took[rate]), "tpot_ms": statistics.median(tpot[rate]) * 1e3,
                     "request_ms": request_ms, "audits_run": c.run if c else 0,
                     "audits_dropped": c.dropped if c else 0, "audits_failed": c.failed if c else 0,
                     "recompute_ms": per_audit,
                     "recompute_over_request": per_audit / request_ms if per_audit else None})
    for row in rows:
        row["tpot_vs_rate0"] = row["tpot_ms"] / rows[0]["tpot_ms"]  # type: ignore[operator]
    return rows


def parity(path: Path, prompt_len: int, generated: int) -> dict[str, object]:
    """How far a recomputation's logits are from the chain's: on the chain's schedule, and as one prefill.

    The chain (2 stages) prefills the prompt and decodes ``generated`` positions one at a time; the
    recomputation reruns the sequence range by range on the same schedule
    (:func:`~meshllm.split.auditor.recompute`'s way), and the naive one as a single forward per range.
    """
    import numpy as np

    from meshllm.split.audit import schedule

    hp = read_hparams(GGUFFile(path))
    mid, n = hp.n_layers // 2, prompt_len + generated
    ids = np.random.default_rng(0).integers(3, hp.vocab, n)
    calls = schedule(prompt_len, n, 256)

    def chain() -> np.ndarray:
        a, b = (StageModel.load(path, 0, mid, max_context=1024, threads=2),
                StageModel.load(path, mid, hp.n_layers, max_context=1024, threads=2))
        rows = [b.forward("s", a.forward("s", ids[s:e], s), s, last_only=True)[-1] for s, e in calls]
        a.close()
        b.close()
        return np.stack(rows[-(generated + 1):])

    def recomputed(calls: list[tuple[int, int]]) -> np.ndarray:
        x, rows = ids, []
        for start, end in ((0, mid), (mid, hp.n_layers)):
            stage = StageModel.load(path, start, end, max_context=1024, threads=1)
            if end < hp.n_layers:
                x = np.concatenate([stage.forward("r", x[s:e], s) for s, e in calls])
            elif len(calls) > 1:  # the recomputation's way: the chain's calls, the last row of each
                rows = [stage.forward("r", x[s:e], s, last_only=True) for s, e in calls if e >= prompt_len]
            else:  # one forward: the logits of every position
                rows = [stage.forward("r", x, 0)]
            stage.close()
        return np.concatenate(rows)[-(generated + 1):]

    served = chain()
    same = recomputed(calls)
    one = recomputed([(0, n)])
    assert same.shape == one.shape == served.shape
    return {"max_diff_schedule": float(np.abs(served - same).max()), "argmax_same_schedule":
            bool((served.argmax(1) == same.argmax(1)).all()), "max_diff_one_prefill": float(np.abs(served - one).max()),
            "argmax_same_one_prefill": bool((served.argmax(1) == one.argmax(1)).all())}


def table(name: str, rows: list[dict[str, object]]) -> str:
    def f(v: object, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    lines = [name, "| audit rate | requests | TPOT ms | vs rate 0 | request ms | audits run | dropped | failed | "
             "recompute ms / audit | recompute / request |", "|---|---|---|---|---|---|---|---|---|---|"]
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
            from meshllm.models.bundled import gemma_model_path

            path, name = gemma_model_path(), "gemma3 270M Q4_K_M"
        else:
            path = write_tiny_llama(Path(tmp) / "tiny.gguf", n_layers=6, width=256, ffn=512, seed=1)
            name = "tiny llama (6 x 256)"
        match = parity(path, 40, 24)
        rows = asyncio.run(run(path, args.rounds, args.block, args.tokens))
    print(f"{name}: recomputed logits vs the chain's (40-token prompt, 24 decoded), max |difference|: "
          f"{match['max_diff_schedule']:.3g} on the chain's schedule (same argmax: {match['argmax_same_schedule']}), "
          f"{match['max_diff_one_prefill']:.3g} as one prefill (same argmax: {match['argmax_same_one_prefill']})")
    print(table(f"{name}, 2 stages, {len(PROMPT)}-token prompt, {args.tokens} tokens per request", rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    out.write_text(json.dumps({"date": stamp, "model": name, "tokens": args.tokens, "parity": match, "rows": rows},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
