"""Real nodes behind the WAN emulator: a 3-stage split over 40 ms links that lose 1 % of datagrams.

Everything between the nodes (QUIC handshakes, gossip, probes, stage lanes) crosses the emulator, so
this is the real stack on a lossy long link: the chain must still form and complete requests
(QUIC retransmits what the link drops), and the RTT the datagram probes measure must be within 20 %
of the configured one, both before and after the requests.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from nodes import NodeProcess, running_nodes, wait_until
from tinymodels import write_tiny_llama

from wan import LinkProfile, WanEmulator

pytestmark = pytest.mark.timeout(180)

RTT_MS = 40.0


def probe_rtts(nodes: list[NodeProcess]) -> list[float]:
    """Every node's probe RTT to every peer (None while unmeasured is left out)."""
    return [p["rtt_ms"] for node in nodes for p in node.status()["peers"] if p["rtt_ms"] is not None]


def settled_near_rtt(nodes: list[NodeProcess], timeout: float) -> list[float]:
    """Every probe RTT within 20 % of the configured one, once the probes' average has settled.

    The average (EWMA over 250 ms probes) starts from samples taken while the nodes were still
    loading, and rises while lanes queue datagrams; a second or two later it reflects the link again.
    """
    seen: list[list[float]] = []

    def near() -> bool:
        seen.append(probe_rtts(nodes))
        return len(seen[-1]) == 6 and all(abs(ms - RTT_MS) <= 0.2 * RTT_MS for ms in seen[-1])

    try:
        wait_until(near, timeout, interval=0.25)
    except AssertionError:
        raise AssertionError(f"probe RTTs never settled within 20 % of {RTT_MS} ms: last {seen[-1]}") from None
    return seen[-1]


def test_split_over_lossy_40ms_links_completes_and_probes_see_the_rtt(tmp_path: Path) -> None:
    gguf = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=6, seed=3)
    with WanEmulator(LinkProfile.rtt(RTT_MS, loss=0.01), seed=2) as wan, running_nodes() as nodes:
        emulated = [wan.add_node(name) for name in ("coord", "w1", "w2")]
        coord = NodeProcess(tmp_path / "coord", ["--model", str(gguf), "--split", "force", "--stages", "3",
                                                 *emulated[0].args], "coord")
        nodes.append(coord)
        invite = coord.wait_ready()["invite"]
        nodes += [NodeProcess(tmp_path / n.name, ["--worker", "--join", invite, *n.args], n.name)
                  for n in emulated[1:]]
        ready = coord.wait_event(lambda e: e["type"] == "split_ready", 90)
        assert ready["stages"][0][0] == "coord" and len(ready["stages"]) == 3
        # every hop of the chain names a front: nodes reach each other only through the emulator
        hops = {p["addr"] for p in coord.status()["peers"]}
        assert hops == {n.front_addr for n in emulated[1:]}

        for node in nodes[1:]:
            node.wait_ready()
        settled_near_rtt(nodes, 30)

        client = openai.OpenAI(base_url=coord.api + "/v1", api_key="x", max_retries=0, timeout=60)
        kwargs = {"model": ready["model"], "prompt": "Hello, world", "max_tokens": 32, "temperature": 0}
        whole = client.completions.create(**kwargs)
        assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 32
        streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices)
        assert streamed == whole.choices[0].text

        settled_near_rtt(nodes, 10)
        stats = wan.stats()
        assert sum(s.dropped_random for s in stats.values()) > 0  # the link did lose datagrams
        assert {pair for pair, s in stats.items() if s.sent} >= {("coord", "w1"), ("w1", "coord"), ("coord", "w2"),
                                                                  ("w2", "coord"), ("w1", "w2"), ("w2", "w1")}
