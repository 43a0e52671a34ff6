"""Owner commands through real nodes: what a command costs on this node, one hop away, and relayed.

Three ``meshllm serve`` subprocesses on 127.0.0.1 (tiny model): ``alpha`` holds the owner keystore,
``beta`` is certified and connected to it, ``gamma`` is certified but accepts only beta as a peer
(trust policy allowlist), so alpha's commands reach it through beta. Envelopes are sealed here and
posted to alpha's ``/api/owner/relay`` (so the CLI's start-up is not counted), and each answer is
opened and checked like ``meshllm owner`` does.

Measured, interleaved round by round so all three see the same machine load:
``status`` round trips to alpha itself (signing, gate, executor, no network), to beta (one QUIC
hop) and to gamma (two hops); then hot ``load`` of a second tiny model on beta, from the command
sent to every node listing it, and its ``unload``. Prints medians and p90 and writes JSON.

Usage: ``python bench/owner.py [--rounds 30] [--loads 5] [--out bench/results/owner.json]``
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from meshllm.identity.keys import NodeKey
from meshllm.identity.keystore import unlock_keystore
from meshllm.owner.commands import OwnerCommand, open_result, seal_command

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from nodes import NodeProcess, meshllm, running_nodes, wait_until
from tinymodels import write_tiny_llama

PASSPHRASE = "bench owner passphrase"


def cli(*args: str) -> str:
    env = {**os.environ, "MESHLLM_OWNER_PASSPHRASE": PASSPHRASE}
    done = subprocess.run([sys.executable, "-m", "meshllm", *args], capture_output=True, text=True, env=env,
                          timeout=60)
    if done.returncode:
        raise SystemExit(f"meshllm {' '.join(args)} failed: {done.stderr}")
    return done.stdout


def certify(owner_home: Path, home: Path, owner_pub: str) -> None:
    cli("auth", "trust", "add", owner_pub, "--home", str(home))
    token = json.loads(cli("auth", "sign-node", "--home", str(owner_home), "--json",
                           "--node-id", NodeKey.load_or_create(home).node_id))["token"]
    cli("auth", "install-cert", token, "--home", str(home))


def listed(node: NodeProcess, model: str) -> bool:
    data = httpx.get(f"{node.api}/v1/models", timeout=5).json()["data"]
    return any(m["id"] == model for m in data)


class Owner:
    """Seals commands with the owner key and sends them through alpha's relay route."""

    def __init__(self, alpha: NodeProcess) -> None:
        self.alpha = alpha
        self.key = unlock_keystore(alpha.home / "owner.keystore", PASSPHRASE)
        # a fresh connection per command: a node's API answers keep-alive requests after the first about
        # 40 ms late (curl shows it too; fresh connections take 1-3 ms), which would hide what is measured
        self.client = httpx.Client(timeout=120, headers={**alpha.admin_headers, "Connection": "close"},
                                   trust_env=False)

    def run(self, node: NodeProcess, command: OwnerCommand) -> tuple[float, dict[str, object]]:
        envelope = seal_command(self.key, node.node_id, command, time.time())
        start = time.perf_counter()
        answer = self.client.post(f"{self.alpha.api}/api/owner/relay",
                                  json={"envelope": base64.b64encode(envelope).decode()})
        took = (time.perf_counter() - start) * 1000
        if answer.status_code != 200:
            raise SystemExit(f"{command.op} to {node.name}: {answer.status_code} {answer.text}")
        result = open_result(self.key, base64.b64decode(answer.json()["result"]), envelope, node.node_id, time.time())
        if not result.ok:
            raise SystemExit(f"{command.op} on {node.name} refused: {result.code}: {result.message}")
        return took, result.data


def stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"n": len(samples), "median_ms": round(statistics.median(samples), 2),
            "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--loads", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results/owner.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshllm-owner-bench-") as folder, running_nodes() as nodes:
        tmp = Path(folder)
        tiny, extra = write_tiny_llama(tmp / "tiny.gguf", seed=0), write_tiny_llama(tmp / "extra.gguf", seed=1)
        homes = {n: tmp / n for n in ("alpha", "beta", "gamma")}
        cli("auth", "init", "--home", str(homes["alpha"]))
        cli("auth", "sign-node", "--home", str(homes["alpha"]))  # the owner's own node obeys the owner too
        owner_pub = json.loads(meshllm("auth", "status", "--home", str(homes["alpha"]), "--json").stdout)["owner_pub"]
        certify(homes["alpha"], homes["beta"], owner_pub)
        certify(homes["alpha"], homes["gamma"], owner_pub)
        cli("auth", "trust", "allow", NodeKey.load_or_create(homes["beta"]).node_id, "--home", str(homes["gamma"]))
        cli("auth", "trust", "policy", "allowlist", "--home", str(homes["gamma"]))
        alpha = NodeProcess(homes["alpha"], ["--model", str(tiny)], "alpha")
        nodes.append(alpha)
        invite = alpha.wait_ready()["invite"]
        beta = NodeProcess(homes["beta"], ["--model", str(tiny), "--join", invite], "beta")
        nodes.append(beta)
        beta.wait_ready()
        gamma = NodeProcess(homes["gamma"], ["--client", "--join", invite, "--bootstrap", beta.mesh_addr], "gamma")
        nodes.append(gamma)
        gamma.wait_ready()
        wait_until(lambda: len(alpha.status()["peers"]) == 2, 20.0)
        owner = Owner(alpha)
        samples: dict[str, list[float]] = {"status_self": [], "status_1_hop": [], "status_relayed": [],
                                           "load": [], "listed_everywhere_after_load": [], "unload": []}
        targets = [("status_self", alpha), ("status_1_hop", beta), ("status_relayed", gamma)]
        for _ in range(2):  # warm-up: connections, first-use imports
            for _, node in targets:
                owner.run(node, OwnerCommand(op="status"))
        for i in range(args.rounds):
            for name, node in targets[i % 3:] + targets[: i % 3]:
                samples[name].append(owner.run(node, OwnerCommand(op="status"))[0])
        for _ in range(args.loads):
            took, _ = owner.run(beta, OwnerCommand(op="load", model=str(extra)))
            returned = time.perf_counter()
            wait_until(lambda: all(listed(n, "extra") for n in (alpha, beta, gamma)), 10.0, interval=0.01)
            samples["load"].append(took)
            samples["listed_everywhere_after_load"].append((time.perf_counter() - returned) * 1000)
            samples["unload"].append(owner.run(beta, OwnerCommand(op="unload", model="extra"))[0])
            wait_until(lambda: not any(listed(n, "extra") for n in (alpha, beta, gamma)), 10.0, interval=0.01)
    results = {name: stats(values) for name, values in samples.items()}
    print(f"{'measure':<30} {'n':>4} {'median ms':>10} {'p90 ms':>9}")
    for name, row in results.items():
        print(f"{name:<30} {row['n']:>4} {row['median_ms']:>10.2f} {row['p90_ms']:>9.2f}")
    hop, relayed, own = (results[k]["median_ms"] for k in ("status_1_hop", "status_relayed", "status_self"))
    ratios = {"1_hop_over_self": round(hop / own, 2), "relayed_over_1_hop": round(relayed / hop, 2)}
    print(f"ratios (medians): one hop / this node {ratios['1_hop_over_self']}x, "
          f"relayed / one hop {ratios['relayed_over_1_hop']}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"results": results, "ratios": ratios, "rounds": args.rounds,
                                    "loads": args.loads}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
