"""A mesh of dozens of real ``meshllm serve`` processes under churn, for bench/mesh_dozens.py and a small slow test.

:func:`run_churn` starts an owner and ``nodes - 1`` joiners on 127.0.0.1 (the tiny model on ``serving`` of
them, ``--worker`` and ``--client`` members, and ``passive`` passive clients), then for ``duration``
seconds kills (``kill -9``) and restarts 10 % of the members one after another while chat threads
stream through random entry nodes that are never killed (a user's own node). It reports every
chat's outcome (a killed serving node must be survived by failover or replay), how long after the
last restart every survivor's view held exactly the live members, per-node RSS and gossip bytes/s.
"""

from __future__ import annotations

import random
import re
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from nodes import HTTP, NodeProcess, running_nodes, wait_until
from tinymodels import write_tiny_llama

MODEL = "tiny"


@dataclass
class Member:
    """One member's slot: its home and arguments survive restarts, its process does not."""

    name: str
    home: Path
    args: list[str]
    serving: bool
    proc: NodeProcess | None = None

    def start(self) -> NodeProcess:
        self.proc = NodeProcess(self.home, self.args, self.name)
        return self.proc

    def start_through(self, members: list[Member], rng: random.Random) -> NodeProcess:
        """Start, dialing two random members that are up (not only the owner: dozens joining at once
        would queue on it past the bootstrap deadline)."""
        ready = [m.proc.mesh_addr for m in members if m is not self and m.proc is not None and m.proc.ready
                 and m.proc.proc.poll() is None]
        self.args = _without_bootstrap(self.args) + [
            arg for addr in rng.sample(ready, min(2, len(ready))) for arg in ("--bootstrap", addr)]
        return self.start()

    def wait_ready(self, members: list[Member], rng: random.Random, procs: list[NodeProcess], timeout: float,
                   attempts: int = 3) -> None:
        """Wait for ``ready``; a start that gave up (a loaded host: no member answered in time) is retried."""
        for attempt in range(attempts):
            assert self.proc is not None
            try:
                self.proc.wait_ready(timeout)
                return
            except AssertionError:
                if self.proc.proc.poll() is None or attempt == attempts - 1:
                    raise
            procs.append(self.start_through(members, rng))


@dataclass
class ChatLog:
    """Outcomes of the chats, written by the chat threads."""

    ok: int = 0
    failed: list[str] = field(default_factory=list)
    replayed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def rss_mb(pid: int) -> float:
    match = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(match.group(1)) / 1024 if match else 0.0


def gossip_bytes(node: NodeProcess) -> float:
    text = HTTP.get(node.api + "/metrics", headers=node.admin_headers, timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(r'^meshllm_stream_bytes_total\{[^}]*kind="gossip"[^}]*\} (\S+)$',
                                                       text, re.M))


def peers_of(node: NodeProcess) -> tuple[list[dict[str, Any]], float] | None:
    """The peers ``node`` lists and when (``time.monotonic()``) its answer arrived; None: no answer in time."""
    try:
        peers = node.status(timeout=30)["peers"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):  # no answer, or an error's body
        return None
    return peers, time.monotonic()


def _without_bootstrap(args: list[str]) -> list[str]:
    """``args`` less its ``--bootstrap ADDR`` pairs (a restarted member dials members that are up now)."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--bootstrap":
            skip = True
        else:
            out.append(arg)
    return out


@dataclass
class Convergence:
    """When the views agreed (see :func:`converged`), and the last changes that made them agree."""

    seen_s: float
    """When a sweep saw every view agree."""
    settled_s: float
    """When the last change that the sweep saw happened in any view (never after ``seen_s``)."""
    latest: list[str]
    """The latest changes, newest first: ``"+5.91 s n9: n49 alive"`` (at, whose view, which peer, now in what state)."""


def converged(watchers: list[Member], live: Any, timeout: float, since: float | None = None,
              names: dict[str, str] | None = None) -> Convergence:
    """Wait until every one of ``watchers`` (members, or passive clients) lists exactly the other live
    members; times are seconds from ``since`` (a ``time.monotonic()``; default: the call), ``names``
    names node ids in messages. On timeout, an AssertionError naming every view that differed and how
    (a missing member's state there: down, left, or absent).

    Each sweep reads every view at once (one thread per watcher), so the views it compares are those
    of one moment: read one after another, 50 status calls on a saturated 2-core host took longer
    than the 5 s a convergence is meant to take, and any passing false down anywhere in that span
    restarted the sweep. Even at once, a sweep takes 2.5-3.6 s there, so the sweep that sees the
    views agree comes up to that long after they did. ``settled_s`` dates it from the views
    themselves: each peer's ``changed_s`` says how long ago it joined or left the watcher's view (a
    suspicion is no change: alive and suspect are both members), so the last such change in any view
    is when the views became what the sweep saw; it is counted back from when the answer arrived, so
    never too early."""
    differs: list[str] = []
    start = time.monotonic() if since is None else since
    changes: list[tuple[float, str]] = []

    def sweep() -> bool:
        known = {**(names or {}), **{m.proc.node_id: m.name for m in watchers if m.proc is not None}}
        want = live()
        with ThreadPoolExecutor(len(watchers)) as pool:
            answers = list(pool.map(lambda m: peers_of(m.proc), watchers))
        differs.clear()
        changes.clear()
        for m, answer in zip(watchers, answers, strict=True):
            assert m.proc is not None
            mine = want - {m.proc.node_id}
            if answer is None:
                differs.append(f"{m.name}: no answer")
                continue
            peers, received = answer
            states = {p["node_id"]: p["state"] for p in peers}
            if (seen := {n for n, s in states.items() if s in ("alive", "suspect")}) != mine:
                missing = sorted(f"{known.get(n, n[:8])} ({states.get(n, 'absent')})" for n in mine - seen)
                differs.append(f"{m.name}: missing {missing}, extra {sorted(known.get(n, n[:8]) for n in seen - mine)}")
            changes.extend((received - p["changed_s"] - start,
                            f"{m.name}: {known.get(p['node_id'], p['node_id'][:8])} {p['state']}") for p in peers)
        return not differs

    try:
        wait_until(sweep, timeout, 0.2)
    except AssertionError:
        raise AssertionError(f"views did not converge within {timeout} s: {'; '.join(differs)}") from None
    seen_s = time.monotonic() - start
    changes.sort(reverse=True)
    return Convergence(seen_s, max(0.0, changes[0][0]) if changes else 0.0,
                       [f"{at:+.2f} s {what}" for at, what in changes[:5]])


def false_downs(procs: list[NodeProcess], dead: list[tuple[str, float, float]], names: dict[str, str],
                since: float) -> tuple[list[str], int]:
    """Down verdicts against members that were alive, from every process's events: each verdict as its
    accuser reported it (``"-12.30 s n0 by n17 (silent 2.31 s)"``, seconds from ``since``, a wall-clock
    time), and how many views (members' and passive clients') dropped a live member for a while.
    A victim counts as dead from its kill until 3 s after its restart was ready (its old incarnation
    may still be going down in some views then)."""
    def alive(node: str, at: float) -> bool:
        return not any(n == node and killed <= at <= ready + 3.0 for n, killed, ready in dead)

    verdicts: list[tuple[float, str]] = []
    views = 0
    for proc in procs:
        own = proc.ready.get("node_id")
        for e in list(proc.events):
            if e.get("type") != "peer_left" or e.get("reason") != "down" or not alive(e["node_id"], e["ts"]):
                continue
            views += 1
            if own is not None and e.get("accuser") == own:
                silent = f"silent {e['silent_s']:.2f} s" if "silent_s" in e else "no connection"
                verdicts.append((e["ts"] - since, f"{names.get(e['node_id'], e['node_id'][:8])} by {proc.name} "
                                                  f"({silent})"))
    return [f"{at:+.2f} s {what}" for at, what in sorted(verdicts)], views


def chat_loop(entries: list[NodeProcess], log: ChatLog, stop: threading.Event, rng: random.Random,
              max_tokens: int) -> None:
    """Stream chats through random entry nodes until ``stop``; each must complete (failover/replay inside)."""
    while not stop.is_set():
        node = rng.choice(entries)
        try:
            with HTTP.stream("POST", node.api + "/v1/chat/completions", timeout=120, json={
                    "model": MODEL, "messages": [{"role": "user", "content": f"story {rng.random()}"}],
                    "max_tokens": max_tokens, "stream": True}) as reply:
                body = "".join(reply.iter_text())
            compact = body.replace(" ", "")
            finished = reply.status_code == 200 and compact.rstrip().endswith("[DONE]") and (
                '"finish_reason":"length"' in compact or '"finish_reason":"stop"' in compact)
            with log.lock:
                if finished:
                    log.ok += 1
                else:
                    log.failed.append(f"{node.name}: HTTP {reply.status_code}: {body[-1000:]!r}")
        except httpx.HTTPError as exc:
            with log.lock:
                log.failed.append(f"{node.name}: {type(exc).__name__}: {exc}")


def run_churn(base: Path, *, nodes: int, serving: int, workers: int, passive: int, duration: float,
              churn: float = 0.1, chat_threads: int = 2, max_tokens: int = 24, seed: int = 1, batch: int = 8,
              settle_timeout: float = 120.0, gossip_window: float = 10.0, on_progress: Any = print) -> dict[str, Any]:
    """Run the churn scenario; returns the figures (see the module docstring). Gossip bytes/s are
    measured over ``gossip_window`` seconds after the views converged (0: not measured, None in the figures)."""
    rng = random.Random(seed)
    gguf = write_tiny_llama(base / f"{MODEL}.gguf", seed=2)
    serve = ["--model", str(gguf), "--threads", "1", "--parallel", "2"]
    with running_nodes() as procs:
        owner = Member("n0", base / "n0", list(serve), True)
        procs.append(owner.start())
        token = owner.proc.wait_ready(settle_timeout)["invite"]
        members = [owner]
        for i in range(1, nodes):
            role = serve if i < serving else ["--worker"] if i < serving + workers else ["--client", "--member"]
            members.append(Member(f"n{i}", base / f"n{i}", [*role, "--join", token], i < serving))
        clients = [Member(f"p{i}", base / f"p{i}", ["--client", "--join", token], False)
                   for i in range(passive)]
        t0 = time.monotonic()
        joiners = [*members[1:], *clients]
        for i in range(0, len(joiners), batch):  # a batch at a time, each through members already in
            for m in joiners[i:i + batch]:
                procs.append(m.start_through(members, rng))
            for m in joiners[i:i + batch]:
                m.wait_ready(members, rng, procs, settle_timeout)
        started_s = time.monotonic() - t0
        on_progress(f"{nodes} members and {passive} passive clients ready in {started_s:.0f} s")
        live = lambda: {m.proc.node_id for m in members if m.proc is not None and m.proc.proc.poll() is None}  # noqa: E731
        names = {m.proc.node_id: m.name for m in members if m.proc is not None}
        converged(members, live, settle_timeout)

        # victims: 10 % of the members, never the owner; serving ones among them (replay is what is tested)
        pool = members[1:]
        k = max(1, round(churn * nodes))
        victims = rng.sample([m for m in pool if m.serving], min(k // 2 + 1, serving - 1)) if serving > 1 else []
        victims += rng.sample([m for m in pool if m not in victims], k - len(victims))
        entries = [m.proc for m in [*members, *clients] if m not in victims and not m.serving] or [owner.proc]
        log, stop = ChatLog(), threading.Event()
        threads = [threading.Thread(target=chat_loop, args=(entries, log, stop, random.Random(seed + i), max_tokens),
                                    daemon=True) for i in range(chat_threads)]
        for t in threads:
            t.start()
        step = duration / len(victims)
        dead: list[tuple[str, float, float]] = []  # (node id, killed, ready again): wall-clock times
        for victim in victims:
            time.sleep(step / 2)
            on_progress(f"kill -9 {victim.name}{' (serving)' if victim.serving else ''}")
            assert victim.proc is not None
            victim.proc.kill()
            killed = time.time()
            time.sleep(step / 2)
            procs.append(victim.start_through([m for m in members if m is not victim], rng))
            victim.wait_ready(members, rng, procs, settle_timeout)
            dead.append((victim.proc.node_id, killed, time.time()))
            on_progress(f"restarted {victim.name}")
        restarted, restarted_wall = time.monotonic(), time.time()
        views = converged(members, live, settle_timeout, restarted, names)
        passive_views = converged(clients, live, settle_timeout, restarted, names) if clients else Convergence(0, 0, [])
        stop.set()
        for t in threads:
            t.join(180)
        replays = sum(1 for m in [*members, *clients] for e in m.proc.events if e.get("type") == "request_replayed")
        gossip: list[float] = []
        if gossip_window > 0:
            g0 = {m.name: gossip_bytes(m.proc) for m in members}
            w0 = time.monotonic()
            time.sleep(gossip_window)
            elapsed = time.monotonic() - w0
            gossip = [(gossip_bytes(m.proc) - g0[m.name]) / elapsed for m in members]
        rss = [rss_mb(m.proc.proc.pid) for m in [*members, *clients]]
        verdicts, views_hit = false_downs(procs, dead, names, restarted_wall)
        return {
            "nodes": nodes, "serving": serving, "workers": workers, "passive": passive, "duration_s": duration,
            "started_s": round(started_s, 1),
            "victims": [v.name + (" (serving)" if v.serving else "") for v in victims],
            "chats_ok": log.ok, "chats_failed": log.failed, "replays": replays,
            "converge_after_last_restart_s": round(views.settled_s, 2), "converge_seen_s": round(views.seen_s, 2),
            "latest_changes": views.latest,
            "passive_converge_s": round(passive_views.settled_s, 2), "passive_seen_s": round(passive_views.seen_s, 2),
            "passive_latest_changes": passive_views.latest,
            "rss_mb_median": round(statistics.median(rss), 1), "rss_mb_max": round(max(rss), 1),
            "gossip_Bps_median": round(statistics.median(gossip)) if gossip else None,
            "gossip_Bps_max": round(max(gossip)) if gossip else None,
            "false_down_verdicts": verdicts, "false_down_views": views_hit,
        }
