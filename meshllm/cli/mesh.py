"""``meshllm mesh``: create and show the mesh this node owns, and revoke its members."""

from __future__ import annotations

from pathlib import Path

import click

from meshllm.cli.common import api_option, echo_json, home_dir, home_option, json_option
from meshllm.cli.invite import post_revocation
from meshllm.errors import ConfigError
from meshllm.mesh.admission import MeshKey


@click.group()
def mesh() -> None:
    """Create or show this node's own mesh (the mesh key lives in the node's home)."""


@mesh.command("create")
@home_option
@click.option("--force", is_flag=True, help="Replace an existing mesh key (its mesh can no longer invite).")
@json_option
def create(home: Path | None, force: bool, as_json: bool) -> None:
    """Create a new mesh key and print the new mesh id."""
    folder = home_dir(home)
    existing = MeshKey.load(folder)
    if existing is not None and not force:
        raise ConfigError(f"{folder} already holds mesh {existing.mesh_id}",
                          hint="use `meshllm mesh show`, or --force to replace it")
    key = MeshKey.generate()
    key.save(folder)
    if as_json:
        echo_json({"mesh_id": key.mesh_id, "home": str(folder)})
    else:
        click.echo(key.mesh_id)


@mesh.command("show")
@home_option
@json_option
def show(home: Path | None, as_json: bool) -> None:
    """Print the id of the mesh whose key this node holds."""
    folder = home_dir(home, create=False)
    key = MeshKey.load(folder)
    if key is None:
        raise ConfigError(f"no mesh key in {folder}", hint="create one with `meshllm mesh create`")
    if as_json:
        echo_json({"mesh_id": key.mesh_id, "mesh_pub": key.public.hex()})
    else:
        click.echo(key.mesh_id)


@mesh.command("revoke-node")
@click.argument("node_id")
@api_option
@json_option
def revoke_node(node_id: str, api: str, as_json: bool) -> None:
    """Revoke a node id in the mesh of the node at --api: every member drops it and refuses it from then on."""
    post_revocation(api, "node", node_id.strip(), as_json)
