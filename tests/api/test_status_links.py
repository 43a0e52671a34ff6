"""``/api/status`` ``links``: every measured link once, from the RTT rows in the members' records."""

from __future__ import annotations

from meshllm.api.status import mesh_links
from meshllm.mesh.records import PeerRecord, RttEntry


def record(node: str, **rtt: tuple[float, str]) -> PeerRecord:
    return PeerRecord(node_id=node, mesh_id="mesh-x", seq=1, membership_proof=b"",
                      rtt={peer: RttEntry(ms, path) for peer, (ms, path) in rtt.items()})  # type: ignore[arg-type]


def test_each_pair_once_with_the_mean_rtt_of_both_ends() -> None:
    links = mesh_links([record("a", b=(1.0, "direct"), c=(30.0, "relay")), record("b", a=(3.0, "direct")),
                        record("c")])
    assert links == [{"a": "a", "b": "b", "rtt_ms": 2.0, "path": "direct"},
                     {"a": "a", "b": "c", "rtt_ms": 30.0, "path": "relayed"}]


def test_ends_that_disagree_report_the_better_path() -> None:
    # One end still reports the relay it started on; the other already moved to the punched path.
    (link,) = mesh_links([record("b", a=(12.0, "relay")), record("a", b=(10.0, "punched"))])
    assert link == {"a": "a", "b": "b", "rtt_ms": 11.0, "path": "punched"}


def test_links_to_nodes_not_in_the_view_are_left_out() -> None:
    # "gone" left the view (down or departed); its stale distances must not be drawn.
    assert mesh_links([record("a", gone=(1.0, "direct"), a=(0.0, "direct"))]) == []
