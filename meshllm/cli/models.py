"""``meshllm models``: the models a running node can answer for (its own and its mesh peers').

``meshllm models load|unload`` change what the running node itself serves (its admin token is the
authority; to steer another node, use ``meshllm owner NODE ...``).
"""

from __future__ import annotations

from typing import Any

import click
from rich.console import Console
from rich.table import Table

from meshllm.cli.api_client import NodeApi
from meshllm.cli.common import MeshllmGroup, api_option, echo_json, json_option


@click.group("models", cls=MeshllmGroup, invoke_without_command=True)
@api_option
@json_option
@click.pass_context
def models(ctx: click.Context, api: NodeApi, as_json: bool) -> None:
    """List the models the node at --api serves or routes to, with the nodes serving each (`load`/`unload`
    change what it serves)."""
    if ctx.invoked_subcommand is not None:
        return
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


# ---- hot load and unload on the running node (issue 17) ----------------------------------------------


@models.command("load")
@click.argument("model")
@api_option
@json_option
@click.option("--timeout", type=click.FloatRange(1.0, 3600.0), default=300.0, show_default=True,
              help="Seconds to wait for the model to load.")
def load(model: str, api: NodeApi, as_json: bool, timeout: float) -> None:
    """Load MODEL (a GGUF path or `default`) into the running node and serve it, without a restart."""
    answer = api.post_json("/api/models/load", {"model": model}, timeout=timeout)
    if as_json:
        echo_json(answer)
    elif answer["loaded"]:
        click.echo(f"loaded {answer['model']} ({answer['engine']}, context {answer['context']}); "
                   "the mesh lists it within a gossip round")
    else:
        click.echo(f"{answer['model']} was already served")


@models.command("unload")
@click.argument("model")
@api_option
@json_option
@click.option("--timeout", type=click.FloatRange(0.0, 600.0), default=60.0, show_default=True,
              help="Seconds requests in flight may take to finish; those still running then are cancelled.")
def unload(model: str, api: NodeApi, as_json: bool, timeout: float) -> None:
    """Stop serving MODEL: no new request reaches it, running ones finish, then it is freed."""
    answer = api.post_json("/api/models/unload", {"model": model, "timeout_s": timeout}, timeout=timeout + 10.0)
    if as_json:
        echo_json(answer)
    elif answer["drained"]:
        click.echo(f"unloaded {answer['model']} after its requests finished ({answer['waited_s']:g} s)")
    else:
        click.echo(f"unloaded {answer['model']}; {answer['cancelled']} requests still running were cancelled")
