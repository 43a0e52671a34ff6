"""Output integrity of split chains (issue 18, Deliver 5: "a malicious stage forges output").

Real nodes through the CLI. The finding: a fake worker the coordinator placed returned tokens of its
choosing (``PWNED-by-F``) and they reached the client, and nothing detected it. Now, with
``--split-audit 1``, the coordinator recomputes the request from its own file, finds the forged
token, asks the chain's workers for their signed records, names the forger (``split_forgery``),
evicts it and replans without it; the next request's text is the solo node's. An honest chain audited
at rate 1 never reports a failure, greedy or sampled, and an audit within a memory bound smaller
than one stage runs one layer at a time.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from nodes import NodeProcess, running_nodes, wait_until
from tinymodels import write_tiny_llama

pytestmark = pytest.mark.timeout(240)

FORGER = Path(__file__).with_name("forger.py")
MODEL = "tiny"
PROMPT = "Hello, world"
ONE = ["--threads", "1"]


def complete(node: NodeProcess, **params: object) -> str:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, **params}
    reply = httpx.post(node.api + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def split_ready(node: NodeProcess, stages: int) -> dict:
    return node.wait_event(lambda e: e["type"] == "split_ready" and len(e["stages"]) == stages, 90.0)


def audits(node: NodeProcess) -> dict:
    (split,) = node.status()["splits"]
    return split["audits"]


def test_a_forging_stage_is_caught_named_and_evicted(tmp_path: Path) -> None:
    gguf = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=6, seed=3)
    with running_nodes() as nodes:
        # one thread each: four nodes on a loaded 2-core host, whose spinning ggml threads would
        # otherwise starve each other past the chain's 1 s decode deadline
        solo = NodeProcess(tmp_path / "solo", ["--engine", "ggml", "--model", str(gguf), *ONE], "solo")
        coord = NodeProcess(tmp_path / "c", ["--model", str(gguf), "--split", "force", "--stages", "3",
                                             "--split-audit", "1", *ONE], "coord")
        nodes += [solo, coord]
        token = coord.wait_ready()["invite"]
        honest = NodeProcess(tmp_path / "w", ["--worker", "--join", token, *ONE], "w")
        forger = NodeProcess(tmp_path / "f", ["--worker", "--join", token, *ONE], "F", entry=(str(FORGER),))
        nodes += [honest, forger]
        solo.wait_ready()
        expected = complete(solo)
        honest.wait_ready()
        forger.wait_ready()
        split_ready(coord, 3)

        forged = complete(coord)  # what the forger made of it reached this client: the audit runs after
        assert forged != expected  # "PWNED-by-F" when it is the last stage, scrambled text in the middle
        caught = coord.wait_event(lambda e: e["type"] == "split_forgery", 60.0)
        assert caught["nodes"] == [forger.node_id] and caught["names"] == ["F"]
        assert caught["verdict"] == "forged", caught
        assert caught["token_index"] >= 0 and caught["received_token"] != caught["expected_token"]
        (evidence,) = caught["evidence"]
        assert evidence["node"] == forger.node_id and len(bytes.fromhex(evidence["signature"])) == 64

        again = coord.wait_event(lambda e: e["type"] == "split_ready" and len(e["stages"]) == 2
                                 and e["took_s"] is not None and "F" not in [s[0] for s in e["stages"]], 90.0)
        assert [s[0] for s in again["stages"]] == ["coord", "w"]
        (split,) = coord.status()["splits"]
        assert split["untrusted"] == [forger.node_id]
        assert split["audits"]["failed"] == 1
        assert complete(coord) == expected
        wait_until(lambda: audits(coord)["run"] >= 2, 30.0)
        assert audits(coord)["failed"] == 1 and audits(coord)["passed"] >= 1
        logged = [e["message"] for e in coord.events if e["type"] == "log" and "audit of session" in e["message"]]
        assert len(logged) == 1 and "forged F" in logged[0]


def test_an_honest_chain_passes_every_audit_range_by_range(tmp_path: Path) -> None:
    """Rate 1 over many greedy and seeded-sampled requests: no failure. The 1 MiB bound is below a
    stage's layers, so every audit loads a few layers at a time."""
    gguf = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=6, seed=5)
    with running_nodes() as nodes:
        coord = NodeProcess(tmp_path / "c", ["--model", str(gguf), "--split", "force", "--stages", "2",
                                             "--split-audit", "1", "--split-audit-memory", "1", *ONE], "coord")
        nodes.append(coord)
        token = coord.wait_ready()["invite"]
        nodes.append(NodeProcess(tmp_path / "w", ["--worker", "--join", token, *ONE], "w"))
        split_ready(coord, 2)
        requests = [{"prompt": f"{PROMPT} {i}" * (1 + i), "max_tokens": 24} for i in range(5)]
        requests += [{"prompt": f"{PROMPT} {i}", "temperature": 0.9, "top_p": 0.9, "seed": i, "max_tokens": 24}
                     for i in range(5)]
        requests.append({"temperature": 1.0, "max_tokens": 24})  # no seed: the coordinator chose one
        for done, params in enumerate(requests, start=1):
            complete(coord, **params)
            # one at a time, so that none is dropped for a busy auditor: every request is checked
            wait_until(lambda n=done: audits(coord)["run"] + audits(coord)["dropped"] >= n, 60.0)
        final = audits(coord)
        assert final["failed"] == 0 and final["dropped"] == 0, final
        assert final["passed"] == final["run"] == len(requests), final
        assert final["last_ranges"] > 2  # more ranges than the chain has stages: the bound cut them
        assert not [e for e in coord.events if e["type"] == "split_forgery"]


def test_a_forger_honest_on_the_first_request_is_caught_at_its_first_forgery(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29: at the default 5 % rate, a forger honest on a chain's first (always audited) request
    got 18 of 20 forged answers through. Now every request through a node that has not passed its
    probation is audited: the first forged answer is caught."""
    gguf = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=6, seed=3)
    monkeypatch.setenv("MESHLLM_FORGE_FROM", "2")
    with running_nodes() as nodes:
        coord = NodeProcess(tmp_path / "c", ["--model", str(gguf), "--split", "force", "--stages", "2", *ONE],
                            "coord")
        nodes.append(coord)
        token = coord.wait_ready()["invite"]
        forger = NodeProcess(tmp_path / "f", ["--worker", "--join", token, *ONE], "F", entry=(str(FORGER),))
        nodes.append(forger)
        forger.wait_ready()
        split_ready(coord, 2)
        first = complete(coord)
        wait_until(lambda: audits(coord)["run"] >= 1, 60.0)
        assert audits(coord)["passed"] == 1, audits(coord)
        forged = complete(coord, prompt="Another prompt")
        caught = coord.wait_event(lambda e: e["type"] == "split_forgery", 60.0)
        print(f"first (honest): {first!r}; second (forged): {forged!r}; caught: {caught['verdict']} "
              f"{caught['names']}; audits: {audits(coord)}")
        assert caught["nodes"] == [forger.node_id]
        assert audits(coord)["rate"] == 0.05


def test_a_forger_placed_by_a_rebuild_is_caught_on_the_replayed_request(tmp_path: Path) -> None:
    """Issue 29: a request whose chain was rebuilt mid-stream was never audited, so a forger the
    rebuild placed delivered its forged text with status 200 and stayed in the chain."""
    gguf = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=6, seed=3)
    with running_nodes() as nodes:
        coord = NodeProcess(tmp_path / "c", ["--model", str(gguf), "--split", "force", "--stages", "2", *ONE],
                            "coord")
        nodes.append(coord)
        token = coord.wait_ready()["invite"]
        honest = NodeProcess(tmp_path / "w", ["--worker", "--join", token, *ONE], "w")
        nodes.append(honest)
        honest.wait_ready()
        split_ready(coord, 2)
        complete(coord)  # the chain's first request: audited, passes
        wait_until(lambda: audits(coord)["passed"] >= 1, 60.0)
        forger = NodeProcess(tmp_path / "f", ["--worker", "--join", token, *ONE], "F", entry=(str(FORGER),))
        nodes.append(forger)
        forger.wait_ready()
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "stream": True}
        chunks = 0
        with httpx.stream("POST", coord.api + "/v1/completions", json=body, timeout=120) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if chunks == 20:
                        honest.kill()  # the chain is rebuilt on the only other worker: the forger
        coord.wait_event(lambda e: e["type"] == "split_replayed", 10.0)
        caught = coord.wait_event(lambda e: e["type"] == "split_forgery", 60.0)
        print(f"streamed {chunks} chunks; caught: {caught['verdict']} {caught['names']}")
        assert caught["nodes"] == [forger.node_id]
