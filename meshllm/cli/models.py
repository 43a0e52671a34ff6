"""``meshllm models``: the models a running node can answer for (its own and its mesh peers')."""

from __future__ import annotations

from typing import Any

import click
from rich.console import Console
from rich.table import Table

from meshllm.cli.api_client import NodeApi
from meshllm.cli.common import api_option, echo_json, json_option


@click.command("models")
@api_option
@json_option
def models(api: NodeApi, as_json: bool) -> None:
    """List the models the node at --api serves or routes to, with the nodes serving each."""
    listing = api.get_json("/v1/models")["data"]
    own_id = api.get_json("/api/status")["node_id"]
    rows = [_row(entry, own_id) for entry in listing]
    if as_json:
        echo_json(rows)
        return
    if not rows:
        click.echo("No node of this mesh serves a model yet (start one with `meshllm serve --model REF`).")
        return
    table = Table(box=None, header_style="bold")
    for column in ("MODEL", "CONTEXT", "NODES"):
        table.add_column(column)
    for row in rows:
        nodes = ", ".join(f"{n['name']} (this node)" if n["local"] else n["name"] for n in row["nodes"])
        table.add_row(row["id"], str(row["context_length"] or "?"), nodes)
    Console(highlight=False).print(table)


def _row(entry: dict[str, Any], own_id: str) -> dict[str, Any]:
    """One model with its serving nodes, this node marked ``local``."""
    ids = entry.get("nodes", [])
    names = entry.get("node_names") or ids
    return {"id": entry["id"], "context_length": entry.get("context_length"),
            "nodes": [{"id": i, "name": n, "local": i == own_id} for i, n in zip(ids, names, strict=False)]}
