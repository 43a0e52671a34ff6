"""``meshllm publish``: make the running node's mesh findable (or, with ``--off``, private again).

The node does the work (it holds the mesh key, signs listings and republishes them every half
TTL); this command only asks it over its HTTP API, so publishing lasts as long as the node runs.
"""

from __future__ import annotations

import time

import click

from meshllm.cli.api_client import NodeApi
from meshllm.cli.common import api_option, echo_json, json_option


@click.command("publish")
@click.option("--name", default=None, help="Name shown by `meshllm discover` (default: the node's name).")
@click.option("--off", is_flag=True, help="Stop publishing: the mesh leaves discovery within one listing TTL.")
@api_option
@json_option
def publish(name: str | None, off: bool, api: NodeApi, as_json: bool) -> None:
    """Publish the mesh of the running node: anyone can then find it and join it with its open invite."""
    if off and name is not None:
        raise click.UsageError("--name cannot be combined with --off")
    body: dict[str, object] = {"off": True} if off else ({"name": name} if name else {})
    info = api.post_json("/api/publish", body, timeout=30.0)
    if as_json:
        echo_json(info)
    elif off:
        click.echo(f"{info['mesh_id']} is no longer published; it leaves discovery within {info['ttl_s']:g} s")
    else:
        where = " and ".join(w for w, on in (("the LAN (mDNS)", info["lan"]), ("the DHT", info["dht"])) if on)
        left = max(0.0, float(info["expires"]) - time.time())
        click.echo(f"published {info['mesh_id']} as {info['name']!r} on {where or 'its listing endpoint only'}")
        click.echo(f"  models: {', '.join(info['models']) or '(none yet)'}; nodes: {info['node_count']}; "
                   f"listing renewed every {float(info['ttl_s']) / 2:g} s (valid {left:.0f} s)")
        click.echo(f"  others join with: meshllm join {info['mesh_id']}")
