"""A standby node under real load (subprocesses through the CLI, real QUIC and llama.cpp on 127.0.0.1).

``server`` serves ``tiny`` one request at a time (``--parallel 1``: one slot); ``standby`` has ``tiny``
in its standby library;
the load generator sends more concurrent requests than ``server`` can take through the ``--client``
node ``entry``. The standby must start serving within 10 s, the routed requests then spread over
both, and once the load stops the standby unloads after its idle timeout.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from nodes import NodeProcess, running_nodes, wait_until
from tinymodels import write_tiny_llama

pytestmark = pytest.mark.timeout(180)

IDLE_S = 6.0
CONCURRENCY = 4


def serving(node: NodeProcess, model: str = "tiny") -> list[str]:
    data = httpx.get(f"{node.api}/v1/models", timeout=5).json()["data"]
    return next((m["nodes"] for m in data if m["id"] == model), [])


def served_for_peers(node: NodeProcess) -> int:
    return int(node.status()["requests"]["served_for_peers"])


class Load:
    """``CONCURRENCY`` clients sending completions back to back until stopped."""

    def __init__(self, node: NodeProcess) -> None:
        self.client = openai.OpenAI(base_url=f"{node.api}/v1", api_key="x", max_retries=0, timeout=60)
        self.stop = threading.Event()
        self.done = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(CONCURRENCY)]

    def _run(self, i: int) -> None:
        while not self.stop.is_set():
            try:
                self.client.completions.create(model="tiny", prompt=f"client {i}", max_tokens=150, temperature=0.8)
                self.done += 1
            except openai.APIError as exc:
                self.errors.append(str(exc))

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def test_a_standby_takes_load_the_server_cannot_and_leaves_when_idle(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "tiny.gguf", seed=0)
    with running_nodes() as nodes:
        server = NodeProcess(tmp_path / "server", ["--model", str(model), "--parallel", "1"], "server")
        nodes.append(server)
        token = server.wait_ready()["invite"]
        standby = NodeProcess(tmp_path / "standby", ["--standby", "--model", str(model), "--standby-idle", str(IDLE_S),
                                                     "--parallel", "2", "--join", token], "standby")
        # a member: standby nodes act on the demand in gossiped records, and a passive client's is in none
        entry = NodeProcess(tmp_path / "entry", ["--client", "--member", "--join", token], "entry")
        nodes += [standby, entry]
        standby.wait_ready()
        entry.wait_ready()
        wait_until(lambda: serving(entry) == [server.node_id] and len(entry.status()["peers"]) == 2, 15.0)
        state = standby.status()["standby"]
        assert state["enabled"] and state["candidates"] == ["tiny"] and state["serving"] == []
        wait_until(lambda: any(p["name"] == "standby" and p["standby"] == ["tiny"] for p in entry.status()["peers"]),
                   5.0)
        before = {n.name: served_for_peers(n) for n in (server, standby)}

        with Load(entry) as load:
            started = time.monotonic()
            took = wait_until(lambda: standby.node_id in serving(entry), 10.0, interval=0.2)
            promote = standby.wait_event(lambda e: e["type"] == "standby_promote", 1.0)
            print(f"standby serving {took:.1f} s after the load started (reason: {promote['reason']}); "
                  f"{load.done} requests done by then")
            assert promote["reason"] in ("queue", "refused")
            # the load goes on until both have served their share (the spread asserted below)
            wait_until(lambda: served_for_peers(standby) - before["standby"] >= 4
                       and served_for_peers(server) - before["server"] >= 4, 20.0, interval=0.5)
        after = {n.name: served_for_peers(n) for n in (server, standby)}
        spread = {name: after[name] - before[name] for name in after}
        print(f"requests served during the load: {spread}, {load.done} in all, {len(load.errors)} errors, "
              f"{time.monotonic() - started:.1f} s")
        assert spread["server"] >= 4 and spread["standby"] >= 4
        assert not load.errors, load.errors[:3]
        status = entry.status()
        assert any(d["model"] == "tiny" and d["requests"] > 0 for d in status["demand"])
        # a request nobody can serve is demand unmet (the backend tells the owner's counter: no wrapper)
        missing = httpx.post(entry.api + "/v1/chat/completions", headers=entry.admin_headers, timeout=10,
                             json={"model": "nobody-serves-this", "messages": [{"role": "user", "content": "hi"}]})
        assert missing.status_code == 404
        wait_until(lambda: any(d["model"] == "nobody-serves-this" and d["requests"] == d["unmet"] == 1
                               for d in entry.status()["demand"]), 10.0, interval=0.2)

        stopped = time.monotonic()
        demote = standby.wait_event(lambda e: e["type"] == "standby_demote", IDLE_S + 15.0)
        gone = wait_until(lambda: standby.node_id not in serving(entry), 5.0)
        print(f"standby unloaded {time.monotonic() - stopped:.1f} s after the load stopped "
              f"(idle {demote['idle_s']} s; listings followed in {gone:.1f} s)")
        assert demote["idle_s"] >= IDLE_S
        assert serving(entry) == [server.node_id]
        decisions = [d["action"] for d in standby.status()["standby"]["decisions"]]
        assert decisions == ["promote", "demote"]
