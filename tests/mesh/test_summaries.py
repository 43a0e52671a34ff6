"""Summaries: converged peers trade bucket sums and nothing else; differences cost only what differs."""

from __future__ import annotations

import random

from sim import make_key, make_record, make_verifier

from meshllm.mesh import view
from meshllm.mesh.failure import Overstep
from meshllm.mesh.gossip import REFINE_AT, Gossip, Rejected, Send
from meshllm.mesh.messages import Digest, Exchange, Summary, decode_message, encode_message
from meshllm.mesh.records import Load, sign_record

A, B = make_key(20), make_key(21)
OTHERS = [make_key(300 + i) for i in range(6)]


def pair() -> tuple[Gossip, Gossip]:
    """A and B holding the same records: each other and six more nodes."""
    a, b = (Gossip(k, make_record(k), make_verifier(), random.Random(i), now=0.0) for i, k in enumerate((A, B)))
    others = [sign_record(k, make_record(k, seq=5)) for k in OTHERS]
    a.receive(b.node_id, Exchange([b.own_raw, *others]), now=1.0)
    b.receive(a.node_id, Exchange([a.own_raw, *others]), now=1.0)
    a.peer_connected(b.node_id)
    b.peer_connected(a.node_id)
    return a, b


def summary_of(g: Gossip, now: float) -> Summary:
    (send,) = [o for o in g.tick(now) if isinstance(o, Send) and isinstance(o.message, Summary)]
    return send.message


def test_converged_peers_trade_one_summary_and_nothing_else() -> None:
    a, b = pair()
    summary = summary_of(a, 2.0)
    assert decode_message(encode_message(summary)) == summary
    assert len(summary.sums) == 8 * 16**summary.level
    assert b.receive(a.node_id, summary, now=2.0) == []


def test_a_change_costs_a_digest_of_its_bucket_then_the_record() -> None:
    a, b = pair()
    b.update_own(2.0, load=Load(in_flight=3))
    (digest,) = a.receive(b.node_id, summary_of(b, 2.5), now=2.5)
    assert isinstance(digest.message, Digest) and digest.message.level
    assert b.node_id in digest.message.seqs and len(digest.message.seqs) <= 3  # one bucket, not the table
    (exchange,) = b.receive(a.node_id, digest.message, now=2.6)
    assert exchange.message.records == [b.own_raw]
    a.receive(b.node_id, exchange.message, now=2.7)
    assert a.members()[b.node_id].load.in_flight == 3
    assert b.receive(a.node_id, summary_of(a, 3.0), now=3.0) == []


def test_full_buckets_are_refined_before_any_digest() -> None:
    a, b = pair()
    entry = next(iter(a.state.peers.values()))
    fakes = {f"{c}{d}fake{i}": entry for i, (c, d) in enumerate(zip("abcdefgh" * 60, "ab234567" * 60, strict=False))}
    a.adopt(view.ViewState(a.node_id, {**dict(a.state.peers.items()), **fakes}), first_deadline=0.0)
    assert len(a.state.peers) > REFINE_AT * 16
    (reply,) = a.receive(b.node_id, Summary(1, bytes(8 * 16)), now=2.0)
    finer = reply.message
    assert isinstance(finer, Summary) and finer.level == 2 and len(finer.sums) == 8 * len(finer.buckets)
    # Every level-1 bucket A fills differs from B's empty claim: their sixteen sub-buckets, no digest.
    filled = {view.bucket_of(n, 1) for n in [*a.state.peers, a.node_id]}
    assert finer.buckets == [p * 16 + i for p in sorted(filled) for i in range(16)]


def test_a_malformed_or_too_frequent_summary_is_refused() -> None:
    a, b = pair()
    (out,) = a.receive(b.node_id, Summary(2, bytes(8 * 3)), now=2.0)
    assert isinstance(out, Rejected)
    (out,) = a.receive(b.node_id, Summary(1, bytes(8 * 2), buckets=[1, 99]), now=2.0)
    assert isinstance(out, Rejected)
    outs = [a.receive(b.node_id, Summary(1, bytes(8 * 16)), now=2.0) for _ in range(10)]
    assert any(isinstance(o, Overstep) for out in outs for o in out)
