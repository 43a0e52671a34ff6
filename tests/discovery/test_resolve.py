"""Choosing a published mesh for ``--auto`` (pure ranking; the lookups run in tests/node/test_discovery_cluster.py)."""

from __future__ import annotations

import asyncio

import pytest

from meshllm.discovery.listing import Capacity, MeshListing
from meshllm.discovery.resolve import Found, NothingFound, auto_find, rank


def found(name: str, served: list[str] = (), wanted: list[str] = (), tok_s: float = 0.0, nodes: int = 1,
          issued: float = 100.0) -> Found:
    listing = MeshListing(mesh_id=f"mesh-{name}", name=name, open_invite="x", bootstrap=[], models_served=list(served),
                          models_wanted=list(wanted), node_count=nodes, capacity=Capacity(tokens_per_s=tok_s),
                          issued=issued, expires=issued + 60)
    return Found(listing, "dht")


def test_serving_beats_wanting_beats_the_rest_then_speed_nodes_and_age() -> None:
    meshes = [found("fast", tok_s=500), found("asks", wanted=["qwen-7b"]), found("serves", served=["Qwen-7B-q4"]),
              found("serves-more", served=["qwen-7b-q4"], tok_s=90), found("big", served=["qwen-7b"], tok_s=90,
                                                                         nodes=9)]
    assert [f.listing.name for f in rank(meshes, ["qwen-7b"])] == ["big", "serves-more", "serves", "asks", "fast"]
    assert rank(meshes, [])[0].listing.name == "fast"  # nothing wanted: the fastest
    newer = [found("old", issued=1.0), found("new", issued=2.0)]
    assert rank(newer, [])[0].listing.name == "new"


def test_nothing_published_says_what_was_searched() -> None:
    with pytest.raises(NothingFound, match="no published mesh found on nothing"):
        asyncio.run(auto_find(["x"], interfaces=None, bootstrap=[], timeout=1.0))
