"""``meshllm mesh``: create and show the mesh this node owns, seal its key, and revoke its members.

The mesh key (``$MESHLLM_HOME/mesh.key``, mode 0600) can be kept encrypted under a passphrase
(``mesh create --encrypt`` or ``mesh encrypt``), in the owner keystore's format. A node serving an
encrypted mesh key reads the passphrase from ``$MESHLLM_MESH_PASSPHRASE``, or asks on a terminal.
"""

from __future__ import annotations

from pathlib import Path

import click

from meshllm.cli.api_client import NodeApi
from meshllm.cli.common import api_option, echo_json, home_dir, home_option, json_option, mesh_passphrase
from meshllm.cli.invite import post_revocation
from meshllm.errors import ConfigError
from meshllm.mesh.admission import MESH_PASSPHRASE_ENV, MeshKey, mesh_id_for


@click.group()
def mesh() -> None:
    """Create or show this node's own mesh (the mesh key lives in the node's home)."""


@mesh.command("create")
@home_option
@click.option("--force", is_flag=True, help="Replace an existing mesh key (its mesh can no longer invite).")
@click.option("--encrypt", is_flag=True, help="Keep the key encrypted under a passphrase ($MESHLLM_MESH_PASSPHRASE).")
@json_option
def create(home: Path | None, force: bool, encrypt: bool, as_json: bool) -> None:
    """Create a new mesh key and print the new mesh id."""
    folder = home_dir(home)
    existing = MeshKey.stored(folder)
    if existing is not None and not force:
        raise ConfigError(f"{folder} already holds mesh {mesh_id_for(existing[0])}",
                          hint="use `meshllm mesh show`, or --force to replace it")
    key = MeshKey.generate()
    key.save(folder, mesh_passphrase(confirm=True) if encrypt else None)
    if as_json:
        echo_json({"mesh_id": key.mesh_id, "home": str(folder), "encrypted": encrypt})
    else:
        click.echo(key.mesh_id)


@mesh.command("show")
@home_option
@json_option
def show(home: Path | None, as_json: bool) -> None:
    """Print the id of the mesh whose key this node holds (no passphrase needed)."""
    folder = home_dir(home, create=False)
    stored = MeshKey.stored(folder)
    if stored is None:
        raise ConfigError(f"no mesh key in {folder}", hint="create one with `meshllm mesh create`")
    public, encrypted = stored
    if as_json:
        echo_json({"mesh_id": mesh_id_for(public), "mesh_pub": public.hex(), "encrypted": encrypted})
    else:
        click.echo(mesh_id_for(public))


@mesh.command("encrypt")
@home_option
def encrypt(home: Path | None) -> None:
    """Encrypt the mesh key in place under a passphrase (argon2id, like the owner keystore)."""
    folder = home_dir(home, create=False)
    stored = MeshKey.stored(folder)
    if stored is None:
        raise ConfigError(f"no mesh key in {folder}", hint="create one with `meshllm mesh create --encrypt`")
    if stored[1]:
        raise ConfigError(f"the mesh key in {folder} is already encrypted",
                          hint="to change its passphrase, `meshllm mesh decrypt` it first")
    key = MeshKey.load(folder)
    assert key is not None
    key.save(folder, mesh_passphrase(confirm=True))
    click.echo(f"mesh key of {key.mesh_id} encrypted; nodes now need {MESH_PASSPHRASE_ENV} or a terminal to start")


@mesh.command("decrypt")
@home_option
def decrypt(home: Path | None) -> None:
    """Store the mesh key unencrypted again (mode 0600), so nodes start without a passphrase."""
    folder = home_dir(home, create=False)
    stored = MeshKey.stored(folder)
    if stored is None or not stored[1]:
        raise ConfigError(f"no encrypted mesh key in {folder}")
    key = MeshKey.load(folder, mesh_passphrase(confirm=False))
    assert key is not None
    key.save(folder)
    click.echo(f"mesh key of {key.mesh_id} stored unencrypted")


@mesh.command("revoke-node")
@click.argument("node_id")
@api_option
@json_option
def revoke_node(node_id: str, api: NodeApi, as_json: bool) -> None:
    """Revoke a node id in the mesh of the node at --api: every member drops it and refuses it from then on."""
    post_revocation(api, "node", node_id.strip(), as_json)
